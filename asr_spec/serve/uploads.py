"""Taking an upload in, within limits: its bytes counted as they arrive (413 past the limit), its arrival timed
(408 for one that trickles in past `upload_timeout_s`), its file spooled to a temporary file on disk (the reader
streams it from there in blocks, as the CLI streams a file), and its duration read from the container before any
decoding (`header_duration_s`).

Memory while a request is received: starlette's multipart parser keeps at most 1 MB of a file part in memory
(`SpooledTemporaryFile`, the rest on disk) and 1 MB of each text field; the copy to a named file goes by 1 MB.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from typing import Any

from starlette.requests import ClientDisconnect, Request

__all__ = ["ClientDisconnect", "UploadTimeout", "UploadTooLarge", "limited_request", "read_form", "remove", "spool"]

COPY_BUFFER_BYTES = 1 << 20  # the copy of the parsed upload to its named file, 1 MB at a time
MAX_FORM_FIELDS = 32  # text fields a request may carry (OpenAI's endpoint has fewer than 10)


class UploadTooLarge(Exception):
    """More bytes arrived than the request may carry."""

    def __init__(self, n_bytes: int):
        super().__init__(f"{n_bytes} bytes")
        self.n_bytes = n_bytes


class UploadTimeout(Exception):
    """The request body did not arrive within the time allowed."""


def limited_request(request: Request, max_bytes: int, timeout_s: float) -> Request:
    """`request` whose body may hold at most `max_bytes` (else `UploadTooLarge` while it arrives) and must have
    arrived `timeout_s` seconds from now (else `UploadTimeout`); a client that hangs up: `ClientDisconnect`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    receive = request.receive
    n_bytes = 0

    async def receive_limited() -> dict[str, Any]:
        nonlocal n_bytes
        left_s = deadline - loop.time()
        if left_s <= 0:
            raise UploadTimeout()
        try:
            message = await asyncio.wait_for(receive(), left_s)
        except TimeoutError as err:
            raise UploadTimeout() from err
        if message["type"] == "http.request":
            n_bytes += len(message.get("body", b""))
            if n_bytes > max_bytes:
                raise UploadTooLarge(n_bytes)
        return message

    return Request(request.scope, receive_limited)


async def read_form(request: Request) -> Any:
    """The multipart form, parsed (files spooled to disk past 1 MB)."""
    return await request.form(max_files=1, max_fields=MAX_FORM_FIELDS)


def spool(upload: Any) -> str:
    """Copy the parsed upload (a starlette `UploadFile`) to a named temporary file, keeping its extension (ffmpeg
    guesses some formats by it); returns its path. The caller removes it."""
    suffix = os.path.splitext(upload.filename or "")[1][:16]
    if not suffix[1:].isalnum():
        suffix = ""
    handle = tempfile.NamedTemporaryFile(prefix="asr-spec-upload-", suffix=suffix, delete=False)
    try:
        with handle:
            upload.file.seek(0)
            shutil.copyfileobj(upload.file, handle, COPY_BUFFER_BYTES)
    except BaseException:
        os.unlink(handle.name)
        raise
    return handle.name


def remove(path: str) -> None:
    """Remove a spooled upload (already gone: nothing to do)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
