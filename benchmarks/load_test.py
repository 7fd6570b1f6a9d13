"""Bounded load test of `asr-spec serve` on 127.0.0.1: starts the server, sends the committed speech fixtures
sequentially and then from N concurrent clients, checks every answer, prints throughput and latency, stops.

    python -m benchmarks.load_test --preset base --clients 8 --requests-per-client 3
    python -m benchmarks.load_test --preset base --clients 8 --requests-per-client 1 --long-clients 4 --long-s 7200

With --long-clients, a third pass: that many clients each upload --long-s seconds of low-bitrate Opus
(benchmarks/long_upload.py: the 77 s fixture repeated, ~6 kbit/s) while the N short clients send the short clips
again. Every short answer must be its clip's text; a long upload must be transcribed (200) or refused cleanly (an
OpenAI-shaped 413 or 503); a long client that waits more than --long-timeout-s hangs up (counted "abandoned"),
and the server must then free it (its requests-in-flight gauge back to 0). The server's peak resident memory is
read from /proc (VmHWM) after the concurrent short pass and again after the long pass (reset in between through
/proc/<pid>/clear_refs), so the two are peaks of the same process under the two loads.

Each request is one file of tests/fixtures/speech (the short clips and the 77 s long one, round-robin). The
sequential pass answers each request alone and gives every file's expected text; the concurrent pass must give
each request exactly its file's text (nothing lost, nothing mixed up between requests). Throughput is seconds of
audio per second of wall time; the ratio concurrent / sequential is measured in the same run, same server.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
SPEECH = ROOT / "tests" / "fixtures" / "speech"
SHORT_FILES = sorted((SPEECH / "short").glob("*.flac"))
FILES = SHORT_FILES + [SPEECH / "long_75s.flac"]
START_TIMEOUT_S = 300.0  # model loading (and a first conversion into the cache) included
REQUEST_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "asr_spec", "serve", "--preset", args.preset, "--host", "127.0.0.1",
               "--port", str(port), "--batch-size", str(args.batch_size), "--max-requests", "256", *args.serve_args]
    server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with code {server.returncode} while starting")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    server.terminate()
    raise SystemExit(f"the server did not answer /health within {START_TIMEOUT_S:.0f} s")


def transcribe(client: httpx.Client, path: Path) -> tuple[str, float]:
    """One request: (text, latency in seconds)."""
    start = time.perf_counter()
    response = client.post("/v1/audio/transcriptions", files={"file": (path.name, path.read_bytes())},
                           data={"model": "whisper-1", "response_format": "json"})
    latency_s = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"{path.name}: HTTP {response.status_code}: {response.text[:200]}")
    return response.json()["text"], latency_s


def run_pass(base_url: str, jobs: list[Path], clients: int) -> tuple[float, list[tuple[Path, str, float]]]:
    """Send `jobs` from `clients` threads (each with its own connection); (wall seconds, per-request results)."""
    def worker(mine: list[Path]) -> list[tuple[Path, str, float]]:
        with httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as client:
            return [(path, *transcribe(client, path)) for path in mine]

    shares = [jobs[i::clients] for i in range(clients)]
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [item for share in pool.map(worker, shares) for item in share]
    return time.perf_counter() - start, results


def peak_rss_mb(pid: int, reset: bool = False) -> float:
    """The process's peak resident set (VmHWM) in MB; reset: then start a new peak (Linux clear_refs 5)."""
    status = Path(f"/proc/{pid}/status").read_text()
    peak_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))
    if reset:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    return round(peak_kb / 1024, 1)


def metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10.0).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def long_request(base_url: str, path: Path, timeout_s: float) -> tuple[str, float]:
    """One long upload: ("transcribed" | "refused 413 ..." | "abandoned" | "FAILED ..."), seconds waited."""
    start = time.perf_counter()
    try:
        with open(path, "rb") as audio:
            response = httpx.post(f"{base_url}/v1/audio/transcriptions", files={"file": (path.name, audio)},
                                  data={"model": "whisper-1"}, timeout=timeout_s)
    except httpx.TimeoutException:
        return "abandoned", time.perf_counter() - start
    waited_s = time.perf_counter() - start
    if response.status_code == 200 and response.json().get("text"):
        return "transcribed", waited_s
    try:
        error = response.json()["error"]
        clean = response.status_code in (413, 503) and isinstance(error["message"], str)
    except (ValueError, KeyError, TypeError):
        clean = False
    outcome = "refused" if clean else "FAILED"
    return f"{outcome} {response.status_code}: {response.text[:160]}", waited_s


def hostile_pass(args: argparse.Namespace, base_url: str, expected: dict[Path, str]) -> dict:
    """Long uploads and short requests at once; their outcomes and the server's state afterwards."""
    from benchmarks.long_upload import make_long_opus

    long_file = Path(args.work_dir) / f"long-{args.long_s:.0f}s.opus"
    if not long_file.exists():
        make_long_opus(SPEECH / "long_75s.flac", args.long_s, long_file)
    jobs = [SHORT_FILES[i % len(SHORT_FILES)] for i in range(args.clients * args.requests_per_client)]
    start = time.perf_counter()
    with ThreadPoolExecutor(args.long_clients + 1) as pool:
        longs = [pool.submit(long_request, base_url, long_file, args.long_timeout_s) for _ in range(args.long_clients)]
        time.sleep(2.0)  # the long uploads are in before the short requests come
        short_s, shorts = run_pass(base_url, jobs, args.clients)
        long_results = [future.result() for future in longs]
    wrong = sum(expected.get(path, text) != text for path, text, _ in shorts)
    deadline = time.monotonic() + 120
    while metric(base_url, "asr_spec_requests_in_flight") and time.monotonic() < deadline:
        time.sleep(0.5)  # abandoned requests are being freed
    import soundfile as sf

    return {"long_upload": {"file_mb": round(long_file.stat().st_size / 1e6, 2),
                            "audio_s": round(sf.info(str(long_file)).duration)},
            "long_outcomes": [outcome for outcome, _ in long_results],
            "long_waited_s": [round(waited, 1) for _, waited in long_results],
            "short_answered": len(shorts), "short_expected": len(jobs), "short_mismatched_texts": wrong,
            "short": summary(short_s, sum(sf.info(str(p)).duration for p in jobs), shorts),
            "wall_s": round(time.perf_counter() - start, 1),
            "requests_in_flight_after": metric(base_url, "asr_spec_requests_in_flight")}


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="base")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--long-clients", type=int, default=0, help="clients uploading --long-s of audio each")
    parser.add_argument("--long-s", type=float, default=7200.0)
    parser.add_argument("--long-timeout-s", type=float, default=600.0, help="a long client hangs up after this")
    parser.add_argument("--work-dir", default="/tmp", help="where the long upload is made (once)")
    parser.add_argument("serve_args", nargs="*", help="more `asr-spec serve` options, after --")
    args = parser.parse_args()
    import soundfile as sf

    durations = {path: sf.info(str(path)).duration for path in FILES}
    jobs = [FILES[i % len(FILES)] for i in range(args.clients * args.requests_per_client)]
    port = free_port()
    server = start_server(args, port)
    try:
        base_url = f"http://127.0.0.1:{port}"
        run_pass(base_url, FILES[:1], 1)  # warm-up
        seq_s, sequential = run_pass(base_url, jobs, 1)
        con_s, concurrent = run_pass(base_url, jobs, args.clients)
        metrics = httpx.get(f"{base_url}/metrics", timeout=10.0).text
        rss_short_mb = peak_rss_mb(server.pid, reset=True)
        hostile = None
        if args.long_clients:
            hostile = hostile_pass(args, base_url, {path: text for path, text, _ in sequential})
            hostile["peak_rss_mb"] = peak_rss_mb(server.pid)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    expected: dict[Path, str] = {}
    mismatches = 0
    for path, text, _ in sequential + concurrent:
        mismatches += expected.setdefault(path, text) != text
    audio_s = sum(durations[path] for path in jobs)
    report = {
        "preset": args.preset, "batch_size": args.batch_size, "clients": args.clients, "requests": len(jobs),
        "audio_s_per_pass": round(audio_s, 1), "answered": len(sequential) + len(concurrent),
        "expected_answers": 2 * len(jobs), "mismatched_texts": mismatches,
        "sequential": summary(seq_s, audio_s, sequential), "concurrent": summary(con_s, audio_s, concurrent),
        "throughput_ratio_concurrent_vs_sequential": round(seq_s / con_s, 2),
        "tokens_per_target_pass": next((line.split()[-1] for line in metrics.splitlines()
                                        if line.startswith("asr_spec_tokens_per_target_pass ")), None),
        "peak_rss_mb_short_passes": rss_short_mb,
    }
    if hostile is not None:
        report["long_pass"] = hostile
        report["peak_rss_ratio_long_vs_short"] = round(hostile["peak_rss_mb"] / rss_short_mb, 2)
    print(json.dumps(report, indent=2))
    ok = mismatches == 0 and report["answered"] == report["expected_answers"]
    if hostile is not None:
        ok = ok and hostile["short_mismatched_texts"] == 0 and hostile["short_answered"] == hostile["short_expected"]
        ok = ok and not any(outcome.startswith("FAILED") for outcome in hostile["long_outcomes"])
        ok = ok and hostile["requests_in_flight_after"] == 0
    return 0 if ok else 1


def summary(wall_s: float, audio_s: float, results: list[tuple[Path, str, float]]) -> dict[str, float]:
    latencies = [latency for _, _, latency in results]
    return {"wall_s": round(wall_s, 1), "audio_s_per_s": round(audio_s / wall_s, 2),
            "requests_per_s": round(len(results) / wall_s, 3), "p50_latency_s": round(percentile(latencies, 50), 2),
            "p95_latency_s": round(percentile(latencies, 95), 2)}


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
