"""Bounded load test of `asr-spec serve` on 127.0.0.1: starts the server, sends the committed speech fixtures
sequentially and then from N concurrent clients, checks every answer, prints throughput and latency, stops.

    python scripts/load_test.py --preset base --clients 8 --requests-per-client 3

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
FILES = sorted((SPEECH / "short").glob("*.flac")) + [SPEECH / "long_75s.flac"]
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


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="base")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
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
    }
    print(json.dumps(report, indent=2))
    ok = mismatches == 0 and report["answered"] == report["expected_answers"]
    return 0 if ok else 1


def summary(wall_s: float, audio_s: float, results: list[tuple[Path, str, float]]) -> dict[str, float]:
    latencies = [latency for _, _, latency in results]
    return {"wall_s": round(wall_s, 1), "audio_s_per_s": round(audio_s / wall_s, 2),
            "requests_per_s": round(len(results) / wall_s, 3), "p50_latency_s": round(percentile(latencies, 50), 2),
            "p95_latency_s": round(percentile(latencies, 95), 2)}


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
