"""The GPU check (``scripts/gpu-check``): one PASS / FAIL / SKIP line per check, with its seconds.

Without CUDA every GPU check prints SKIP and the CPU-side ones (the device-discipline and NCCL-emulator
suites) still run, so the script exits 0 on a CPU machine (CI runs it that way). With CUDA (one GPU is
enough) it runs, each in a fresh process with a time limit:

- the CUDA-marked tests: every compressor x transport, every strategy, diloco's variants and its resume,
  EmbRace's exchange, mixed precision and the bench, with CUDA tensors, 2 ranks sharing the GPU over
  gloo, against the CPU; Lightning's Trainer on the GPU (one NCCL rank) against the CPU;
- single-rank NCCL: ``lowband.init()`` binds cuda:0, creates NCCL eagerly, and lowband's collectives
  run on it (CUDA tensors through NCCL, CPU tensors through gloo on the same group);
- too many ranks for the GPUs: refused before anything starts, naming the fix;
- a short ``lowband bench --device cuda -n 2`` (gloo, the GPU shared) of ddp, powersgd, slimgc,
  gs-sgd, dreamddp (fmnist-cnn) and embrace (wordlm-sampled), printing the iteration times.

Writes ``gpu-check.json`` (and the bench folders) under ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SINGLE_RANK_NCCL = r"""
import torch, torch.distributed as dist, lowband
ctx = lowband.init()
dev = lowband.device()
assert dev == torch.device("cuda", 0), dev
assert "nccl" in str(dist.get_backend()), dist.get_backend()
x = torch.arange(6.0, device=dev)
assert torch.equal(lowband.allreduce(x), x)
assert torch.equal(lowband.allgather(x), x)
assert torch.equal(lowband.broadcast(x, root=0), x)
assert torch.equal(lowband.alltoall(x)[0], x)
assert torch.equal(lowband.reduce_scatter(x), x)
ys = lowband.grouped_allreduce([x, x[:2].clone()])
assert ys[0].device == dev and torch.equal(ys[1], x[:2])
h = lowband.iallreduce(x.clone(), "average")
assert torch.equal(h.wait(), x)
c = torch.arange(3.0)  # a CPU tensor on the same group: gloo
assert torch.equal(lowband.allreduce(c), c) and lowband.allreduce(c).device.type == "cpu"
print("nccl", torch.cuda.nccl.version(), "on", torch.cuda.get_device_name(dev))
lowband.shutdown()
"""

TOO_MANY_RANKS = r"""
import torch, lowband
from lowband.errors import InvalidArgumentError

def f():
    return 0

if __name__ == "__main__":
    n = torch.cuda.device_count() + 1
    try:
        lowband.launch(f, n)
    except InvalidArgumentError as e:
        assert "NCCL needs one GPU per rank" in str(e), e
        print("refused:", e)
    else:
        raise SystemExit(f"{n} ranks on {n - 1} GPU(s) were not refused")
"""


def _run(cmd: list[str], timeout: float, env: dict[str, str], log: Path) -> tuple[bool, str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        log.write_text(out)
        return False, f"timed out after {timeout:g} s"
    log.write_text(p.stdout + "\n--- stderr ---\n" + p.stderr)
    lines = p.stdout.strip().splitlines() or [""]
    if p.returncode == 0:
        return True, lines[-1]
    failed = [ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))]  # pytest's summary, if it got there
    tail = "\n".join([*failed, lines[-1]]) if failed else (p.stdout + p.stderr)[-1500:]
    return False, tail


def _bench_times(folder: Path) -> str:
    """The bench's iteration times: median [min-max] ms per strategy, and the compute-only time."""
    try:
        summary = json.loads((folder / "results.json").read_text())["summary"]
        rows = summary["strategies"]
        out = [
            f"{name} {1e3 * r['iter_time_median']:.1f} [{1e3 * r['iter_time_min']:.1f}-{1e3 * r['iter_time_max']:.1f}] ms"
            for name, r in rows.items()
        ]
        return "; ".join(out) + f"; compute-only {1e3 * summary['compute_time']:.1f} ms"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"(no readable results.json: {exc!r})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/gpu-check", help="output folder (default results/gpu-check)")
    ap.add_argument("--skip-cpu", action="store_true", help="only the GPU checks (SKIP without CUDA)")
    ap.add_argument("--quick", action="store_true", help="the bench with fewer steps")
    ns = ap.parse_args()
    out = Path(ns.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import torch

    cuda = torch.cuda.is_available()
    card = torch.cuda.get_device_name(0) if cuda else "none"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env.setdefault("PYTHONUNBUFFERED", "1")
    py = sys.executable
    head = f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU: {card} x{torch.cuda.device_count() if cuda else 0}"
    print(f"gpu-check: {head}, Python {platform.python_version()}", flush=True)
    pytest = [py, "-m", "pytest", "-p", "no:warnings", "-p", "no:cacheprovider"]
    steps = "3" if ns.quick else "8"
    # the CUDA tests' ranks are processes sharing the GPU: with pytest-xdist present they run a few at a
    # time (-v names each test as it ends, so a run cut by a time limit still says which failed)
    n_workers = min(8, (os.cpu_count() or 2) // 2) if importlib.util.find_spec("xdist") else 0
    workers = ["-n", str(n_workers)] if n_workers > 1 else []
    bench = [py, "-m", "lowband.cli", "bench", "--device", "cuda", "-n", "2", "--mode", "loopback", "--rounds", "2",
             "--steps-per-round", steps, "--warmup-rounds", "1", "--eval-items", "200", "--force"]  # fmt: skip
    shared = {**env, "LOWBAND_BACKEND": "gloo"}  # 2 ranks on one GPU: NCCL would refuse, gloo shares it
    checks: list[tuple[str, bool, list[str], float, dict[str, str]]] = [
        ("device discipline (meta)", False,
         [*pytest, "-m", "not cuda", "tests/test_device_compress.py", "tests/test_device_sparse.py"], 300, env),
        ("NCCL emulator suite", False, [*pytest, "tests/test_nccl_emulator.py"], 300, env),
        ("single-rank NCCL + collectives", True, [py, "-c", SINGLE_RANK_NCCL], 90, env),
        ("too many ranks refused", True, [py, "-c", TOO_MANY_RANKS], 90, env),
        ("CUDA tests (pytest -m cuda)", True,
         [*pytest, "-m", "cuda", "-v", "-rfEs", "--tb=short", "--timeout=150", *workers, "tests"], 360, env),
        ("bench fmnist-cnn on cuda", True,
         [*bench, "-w", "fmnist-cnn", "-s", "ddp+powersgd+slimgc+gs-sgd+dreamddp:period=5",
          "--out", str(out / "bench-cnn")], 150, shared),
        ("bench wordlm-sampled on cuda", True,
         [*bench, "-w", "wordlm-sampled", "-s", "ddp+powersgd+embrace", "--out", str(out / "bench-wordlm")],
         150, shared),
    ]  # fmt: skip
    results = []
    failed = 0
    for name, needs_gpu, cmd, limit, cenv in checks:
        if ns.skip_cpu and not needs_gpu:
            continue
        if needs_gpu and not cuda:
            print(f"SKIP  {name}: no CUDA here", flush=True)
            results.append({"check": name, "status": "SKIP"})
            continue
        t0 = time.perf_counter()
        log = out / (name.split(" (")[0].replace(" ", "-").replace("+", "").replace("--", "-") + ".log")
        ok, detail = _run(cmd, limit, cenv, log)
        sec = time.perf_counter() - t0
        if ok and name.startswith("bench"):
            detail = _bench_times(Path(cmd[cmd.index("--out") + 1]))
        failed += not ok
        status = "PASS" if ok else "FAIL"
        print(f"{status}  {name} ({sec:.1f} s): {detail}", flush=True)
        results.append(
            {"check": name, "status": status, "seconds": round(sec, 1), "detail": detail, "log": log.name}
        )
    (out / "gpu-check.json").write_text(
        json.dumps({"date": time.strftime("%Y-%m-%d"), "environment": head, "checks": results}, indent=1)
    )
    print(f"gpu-check: {failed} failed; results in {out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
