"""Runtime: init (world of one, torchrun env://, lowband run, launch), hierarchy, groups, CLI."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import lowband
from lowband.testing import run_processes, run_threads

BIN = Path(sys.executable).parent


def test_world_of_one() -> None:
    """Plain python, no launcher: a world of one where every op works."""
    code = textwrap.dedent(
        """
        import torch, lowband
        ctx = lowband.init()
        assert (lowband.rank(), lowband.size(), lowband.local_rank(), lowband.local_size()) == (0, 1, 0, 1)
        assert (lowband.machine_rank(), lowband.machine_size()) == (0, 1)
        assert lowband.allreduce(torch.ones(3)).tolist() == [1.0] * 3
        assert lowband.allgather(torch.ones(2, 2)).shape == (2, 2)
        assert lowband.alltoall(torch.arange(3))[0].tolist() == [0, 1, 2]
        assert lowband.init() is ctx  # idempotent
        lowband.shutdown()
        assert not lowband.is_initialized()
        print("ok")
        """
    )
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize(("n", "local"), [(4, 2), (4, 1), (3, 3), (2, 1)])
def test_hierarchy(n: int, local: int) -> None:
    def rank_fn() -> tuple[int, ...]:
        r = lowband.rank()
        lg = lowband.local_group()
        mg = lowband.machine_group()
        # sum of world ranks inside my machine, and across machines at my local rank
        s_local = int(lowband.allreduce(torch.tensor(r), op="sum", group=lg).item())
        s_cross = int(lowband.allreduce(torch.tensor(r), op="sum", group=mg).item()) if mg is not None else -1
        return (
            lowband.local_rank(),
            lowband.local_size(),
            lowband.machine_rank(),
            lowband.machine_size(),
            s_local,
            s_cross,
        )

    out = run_threads(rank_fn, n, local_size=local)
    machines = n // local
    for r, (lr, ls, mr, ms, s_local, s_cross) in enumerate(out):
        assert (lr, ls, mr, ms) == (r % local, local, r // local, machines)
        m = r // local
        assert s_local == sum(range(m * local, (m + 1) * local))
        assert s_cross == (sum(range(lr, n, local)) if machines > 1 else -1)


def test_bad_local_size() -> None:
    with pytest.raises(
        lowband.testing.RankFailures, match=r"local_size=3 must be >= 1 and divide the world size 4"
    ):
        run_threads(lambda: None, 4, local_size=3)


def test_new_group_bad_ranks() -> None:
    def rank_fn() -> None:
        with pytest.raises(
            lowband.InvalidArgumentError,
            match=r"new_group on rank \d: ranks must be distinct world ranks in \[0, 2\)",
        ):
            lowband.new_group([0, 5])

    run_threads(rank_fn, 2)


def _env_ranks() -> tuple[int, int, int, int, float]:
    s = lowband.allreduce(torch.tensor([float(lowband.rank())]), op="sum").item()
    return lowband.rank(), lowband.size(), lowband.local_rank(), lowband.local_size(), s


def store_listeners() -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) listening on this rank's store port (MASTER_PORT)."""
    port = int(os.environ["MASTER_PORT"])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            addr, hexport = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and int(hexport, 16) == port:
                out.append(addr)
    return out


def _env_ranks_and_store() -> tuple[tuple[int, int, int, int, float], list[str]]:
    return _env_ranks(), store_listeners()


def test_init_from_env_processes() -> None:
    """env:// initialisation (what torchrun provides), with real processes."""
    out = run_processes(_env_ranks, 3, timeout=90)
    assert out == [(r, 3, r, 3, 3.0) for r in range(3)]


def test_launch() -> None:
    """launch runs the ranks; their store listens on 127.0.0.1 only (0100007F), not on every interface."""
    out = lowband.launch(_env_ranks_and_store, 2)
    assert [o[0] for o in out] == [(0, 2, 0, 2, 1.0), (1, 2, 1, 2, 1.0)]
    assert [o[1] for o in out] == [["0100007F"]] * 2


SCRIPT = """
import sys, torch, lowband
lowband.init()
s = lowband.allreduce(torch.tensor([float(lowband.rank())]), op="sum").item()
line = f"RESULT rank={lowband.rank()} size={lowband.size()} local_size={lowband.local_size()} sum={s} args={sys.argv[2:]}"
open(f"{sys.argv[1]}/out{lowband.rank()}.txt", "w").write(line)
sys.path.insert(0, sys.argv[1])
from listeners import store_listeners
open(f"{sys.argv[1]}/store{lowband.rank()}.txt", "w").write(repr(store_listeners()))
lowband.shutdown()
"""


@pytest.mark.parametrize("launcher", ["lowband", "torchrun"])
def test_cli_run_and_torchrun(tmp_path: Path, launcher: str) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    import inspect

    (tmp_path / "listeners.py").write_text(
        "import os\nfrom pathlib import Path\n\n\n" + inspect.getsource(store_listeners)
    )
    if launcher == "lowband":
        # --standalone is a single-machine launch too; an option's value is not taken for the script
        cmd = [str(BIN / "lowband"), "run", "--standalone", "--max-restarts", "0", "-n", "3", str(script)]
        cmd += [str(tmp_path), "--flag", "x"]
    else:
        cmd = [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc-per-node",
            "3",
            str(script),
            str(tmp_path),
            "--flag",
            "x",
        ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [(tmp_path / f"out{r}.txt").read_text() for r in range(3)]
    assert lines == [f"RESULT rank={r} size=3 local_size=3 sum=3.0 args=['--flag', 'x']" for r in range(3)]
    if launcher == "lowband":  # a single-machine launch: its store on 127.0.0.1 only
        assert [(tmp_path / f"store{r}.txt").read_text() for r in range(3)] == ["['0100007F']"] * 3


def test_cli_run_failure_exit_code(tmp_path: Path) -> None:
    script = tmp_path / "bad.py"
    script.write_text("import lowband\nlowband.init()\nraise SystemExit(5 if lowband.rank() == 1 else 0)\n")
    out = subprocess.run(
        [str(BIN / "lowband"), "run", "-n", "2", str(script)], capture_output=True, text=True, timeout=180
    )
    assert out.returncode != 0


def test_cli_demo_small(tmp_path: Path) -> None:
    """The main job, shrunk: the demo's strategies (baselines, DreamDDP, BlueFog ATC) side by side."""
    out = subprocess.run(
        [str(BIN / "lowband"), "demo", "-n", "2", "--mode", "loopback", "--rounds", "2",
         "--steps-per-round", "2", "--out", str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    rows = [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
    for name in ("ddp", "powersgd", "localsgd", "dreamddp", "atc"):  # the terminal table, specs as typed
        assert any(r == name or r.startswith(f"{name}:") for r in rows), out.stdout
    assert (tmp_path / "demo" / "results.json").exists()


def test_ring_example_oracle_in_threads() -> None:
    """examples/ring_average.py (gossip over p2p), at N = 1..4 in threads."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from ring_average import ring_average

    for n in (1, 2, 3, 4):
        res = run_threads(ring_average, n, 6, 257)
        assert all(x["max_err_vs_oracle"] < 1e-12 and x["mean_err"] < 1e-12 for x in res)


def _fds_and_threads() -> tuple[int, int]:
    """Open file descriptors and OS threads (gloo's threads are not Python threads) of this process."""
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def test_destroy_group_frees_fds_and_threads() -> None:
    """Each group holds connections and threads on every member until destroyed; destroying frees them
    (without it, 6 groups on 3 ranks keep ~200 descriptors), and a destroyed group refuses ops."""

    def rank_fn() -> tuple[tuple[int, int], tuple[int, int], str]:
        lowband.barrier()
        before = _fds_and_threads()
        lowband.barrier()
        for _ in range(6):
            g = lowband.new_group([0, 1, 2])
            assert g is not None
            assert lowband.allreduce(torch.ones(2), op="sum", group=g).tolist() == [3.0, 3.0]
            lowband.destroy_group(g)
            lowband.destroy_group(g)  # again: nothing
        lowband.barrier()
        after = _fds_and_threads()
        with pytest.raises(lowband.InvalidArgumentError) as ei:
            lowband.allreduce(torch.ones(2), group=g.unchecked())
        return before, after, str(ei.value)

    before, after, msg = run_threads(rank_fn, 3)[0]
    assert after[0] <= before[0] + 3, f"file descriptors grew from {before[0]} to {after[0]}"
    assert after[1] <= before[1] + 1, f"threads grew from {before[1]} to {after[1]}"
    assert re.fullmatch(
        r"lowband\.allreduce on rank 0: group 'group\d+' was destroyed \(lowband\.destroy_group\)", msg
    )


EXIT_SCRIPT = """
import torch, lowband
import lowband.compat.bluefog.torch as bf
bf.init()
r, n = lowband.rank(), lowband.size()
x = torch.full((100,), float(r))
for _ in range(5):
    x = bf.neighbor_allreduce(x)
g = lowband.new_group([0, 1])
if g is not None:
    lowband.allreduce(torch.ones(2), group=g)
# a receive that nobody answers, with a continuation: its watcher thread is inside gloo at exit
pending = lowband.irecv(torch.empty(3), (r + 1) % n, tag=7).then(lambda t: t)
if r == 1:
    lowband.shutdown()  # an explicit shutdown with that thread waiting is as safe
print("done", r, flush=True)
"""


def _run_ranks(
    script: Path, n: int, extra_env: dict[str, str], timeout: float, *, host_store: bool = True
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``script`` as ``n`` ranks (plain processes). With ``host_store`` this process hosts their
    store on 127.0.0.1 (as a launcher does); else rank 0 hosts it (a bare ``env://`` world)."""
    from lowband.launcher import loopback_store

    store, port = loopback_store() if host_store else (None, lowband.testing.free_port())
    env = dict(
        os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n)
    )
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    env.update(OMP_NUM_THREADS="1", **extra_env)
    if host_store:
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for r in range(n)
    ]  # fmt: skip
    try:
        return [subprocess.CompletedProcess(p.args, p.wait(timeout), *p.communicate()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        del store


def test_exit_without_shutdown_is_clean(tmp_path: Path) -> None:
    """A script that ends without lowband.shutdown() (here on ranks 0 and 2) exits with 0 on every rank,
    several times over:
    lowband closes its groups at exit and waits for its threads, so none wakes inside gloo while the
    interpreter finalizes (which aborted the process: "terminate called without an active exception")."""
    script = tmp_path / "no_shutdown.py"
    script.write_text(EXIT_SCRIPT)
    for attempt in range(2):
        runs = _run_ranks(script, 3, {"LOWBAND_TIMEOUT": "60"}, timeout=120)
        for r, run in enumerate(runs):
            assert run.returncode == 0 and f"done {r}" in run.stdout, (
                f"attempt {attempt}, rank {r}: {run.returncode}\n{run.stderr[-2000:]}"
            )
            assert "terminate called" not in run.stderr


ADOPTED_EXIT_SCRIPT = """
import atexit, os, torch, torch.distributed as dist

def gloo_threads_left():  # runs after lowband's exit hook (atexit runs newest first)
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    print("gloo threads at finalization:", sum(n.startswith(("pt_gloo", "gloo_")) for n in names), flush=True)

atexit.register(gloo_threads_left)
dist.init_process_group("gloo")  # the user's (or Accelerate's) default group, adopted by lowband
import lowband
lowband.init()
g = lowband.new_group([0, 1])
cycle = [g]
cycle.append(cycle)  # a group only a reference cycle still holds
out = [torch.empty(3) for _ in range(2)]
dist.all_gather(out, torch.ones(3))  # temporaries: a gloo worker may drop the last reference late
lowband.allreduce(torch.ones(4))
del out, g, cycle
print("done", dist.get_rank(), flush=True)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc")
def test_exit_destroys_every_gloo_group_before_finalization(tmp_path: Path) -> None:
    """A process group still alive when the interpreter finalizes can abort the process after a run that
    succeeded (a gloo worker dropping a finished work's tensors needs the GIL then: torch issue 190489).
    lowband's exit hook destroys them all, its own and an adopted default group, while the interpreter
    runs: no gloo worker thread is left when the last exit hook runs."""
    script = tmp_path / "adopted.py"
    script.write_text(ADOPTED_EXIT_SCRIPT)
    for r, run in enumerate(_run_ranks(script, 2, {"LOWBAND_TIMEOUT": "60"}, timeout=120)):
        assert run.returncode == 0 and f"done {r}" in run.stdout, (
            f"rank {r}: {run.returncode}\n{run.stderr[-2000:]}"
        )
        assert "gloo threads at finalization: 0" in run.stdout, f"rank {r}: {run.stdout}"


def test_init_env_rank0_hosts_store(tmp_path: Path) -> None:
    """A bare env:// world (no launcher's store): rank 0 hosts the store, as with torch's env://."""
    script = tmp_path / "plain.py"
    script.write_text(
        "import torch, lowband\nlowband.init()\n"
        "print('sum', lowband.allreduce(torch.ones(1), op='sum').item())\nlowband.shutdown()\n"
    )
    runs = _run_ranks(script, 3, {"LOWBAND_TIMEOUT": "60"}, timeout=120, host_store=False)
    assert [(run.returncode, run.stdout.strip()) for run in runs] == [(0, "sum 3.0")] * 3, runs[0].stderr[
        -2000:
    ]


def test_init_names_missing_ranks(tmp_path: Path) -> None:
    """A rank that never starts: the others say which rank did not join, within their timeout."""
    script = tmp_path / "join.py"
    script.write_text("import lowband\nlowband.init()\n")
    from lowband.launcher import loopback_store

    store, port = loopback_store()
    env = dict(
        os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="3", LOWBAND_TIMEOUT="4"
    )
    env.update(TORCHELASTIC_USE_AGENT_STORE="True")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)], env=dict(env, RANK=str(r)), stderr=subprocess.PIPE, text=True
        )
        for r in (0, 2)
    ]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    del store
    for r, err in zip((0, 2), errs, strict=True):
        assert (
            f"lowband.errors.CommTimeoutError: lowband.init on rank {r}: rank(s) [1] of 3 did not join within 4 s"
            in err
        ), err
        assert "frame #" not in err  # no C++ stack dump


def test_init_store_unreachable(tmp_path: Path) -> None:
    """No store at MASTER_ADDR:MASTER_PORT (rank 0, its host, never started): said so, without a stack dump."""
    env = dict(
        os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(lowband.testing.free_port()), WORLD_SIZE="2"
    )
    env.update(RANK="1", LOWBAND_TIMEOUT="2")
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    out = subprocess.run(
        [sys.executable, "-c", "import lowband; lowband.init()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert re.search(
        r"lowband\.init on rank 1: cannot reach the rendezvous store at 127\.0\.0\.1:\d+, hosted by rank 0",
        out.stderr,
    ), out.stderr
    assert "frame #" not in out.stderr


def test_launch_refuses_unguarded_main(tmp_path: Path) -> None:
    """lowband.launch called at the top of a script (no main guard) says so, and how to fix it, at once."""
    script = tmp_path / "unguarded.py"
    script.write_text("import lowband\n\n\ndef fn():\n    return 1\n\n\nprint(lowband.launch(fn, 2))\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert (
        f'lowband.launch: called at line 8 of {script} outside an `if __name__ == "__main__":` block'
        in out.stderr
    ), out.stderr
    guarded = tmp_path / "guarded.py"
    guarded.write_text(
        "import lowband\n\n\ndef fn():\n    return 1\n\n\nif __name__ == '__main__':\n    lowband.launch(fn, 0)\n"
    )
    out = subprocess.run([sys.executable, str(guarded)], capture_output=True, text=True, timeout=120)
    assert "nprocs must be an int >= 1" in out.stderr, out.stderr  # past the guard check


@pytest.mark.parametrize(
    ("argv", "said"),
    [(["-n"], "argument -n/--nproc-per-node/--nproc_per_node/--nprocs/--np: expected one argument"),
     (["-n", "0", "x.py"], "got '0'"), (["-n0", "x.py"], "got '0'"),
     (["--nproc-per-node", "0", "x.py"], "a number of ranks >= 1"),
     (["--np", "two", "x.py"], "a number of ranks >= 1, got 'two'")],
)  # fmt: skip
def test_cli_run_bad_nprocs(argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    from lowband.cli import main

    assert main(["run", *argv]) == 2
    assert said in capsys.readouterr().err


def test_init_timeout_validated() -> None:
    for bad in (0, -1.0, float("nan"), float("inf"), "5", True):
        with pytest.raises(lowband.InvalidArgumentError, match=r"^lowband\.init: timeout must be"):
            lowband.init(timeout=bad)  # type: ignore[arg-type]
    assert not lowband.is_initialized()
