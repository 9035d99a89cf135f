"""The decode threads where `-t` is not given (`backend.context.default_threads`): one per
physical core, counted from the CPU topology as llama.cpp counts it, less one where the cores
are all the CPUs. The topologies are written as sysfs files in a temporary directory: a
machine cannot be made to show SMT siblings, none, or a hybrid Intel's efficiency cores on
demand."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from backend.context import default_threads, physical_cores
from proxy.worker_link import child_env
from tests.conftest import ROOT


def _sysfs(root: Path, siblings: list[str], atoms: str = "") -> Path:
    for cpu, mask in enumerate(siblings):
        d = root / "system" / "cpu" / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings").write_text(mask + "\n")
    if atoms:
        (root / "cpu_atom").mkdir()
        (root / "cpu_atom" / "cpus").write_text(atoms + "\n")
    return root


def test_one_thread_per_physical_core(tmp_path: Path) -> None:
    # 4 cores with their SMT siblings shown (cpu i and i + 4 share a core): 4, half the CPUs
    smt = _sysfs(tmp_path / "smt", ["11", "22", "44", "88", "11", "22", "44", "88"])
    assert physical_cores(range(8), smt) == 4
    # a container's cpuset of one core's two siblings and another's one: 2
    assert physical_cores([0, 4, 1], smt) == 2
    # vCPUs shown as cores of their own (this project's 2-core VMs, Arm servers): every one
    vm = _sysfs(tmp_path / "vm", ["1", "2"])
    assert physical_cores(range(2), vm) == 2
    # a hybrid Intel: 2 performance cores with siblings (cpus 0-3), 4 efficiency cores (4-7),
    # which llama.cpp leaves out ("efficiency cores harm lockstep threading")
    hybrid = _sysfs(tmp_path / "hybrid", ["03", "03", "0c", "0c", "10", "20", "40", "80"], "4-7")
    assert physical_cores(range(8), hybrid) == 2


def test_without_a_topology_llama_cpps_fallback(tmp_path: Path) -> None:
    assert physical_cores(range(4), tmp_path) == 4
    assert physical_cores(range(16), tmp_path) == 8


def test_the_default_leaves_a_core_where_no_sibling_can_take_the_other_threads() -> None:
    """One per physical core, less one where the cores are all the CPUs (module docstring):
    on this project's 2-vCPU machines 1, as before; with SMT siblings shown, the cores."""
    cpus = len(os.sched_getaffinity(0))
    cores = physical_cores(sorted(os.sched_getaffinity(0)))
    assert default_threads() == max(cores - 1 if cores >= cpus else cores, 1)


def test_the_thread_defaults_count_a_cpusets_cpus_not_the_hosts() -> None:
    """In a process held to one CPU (as `docker run --cpuset-cpus 0` holds a container),
    `-t -1` and `-tb -1` (llama-server's: every CPU) give 1, not the host's `os.cpu_count()`;
    the prefill threads' default and the ready line's cores note count the same
    (`backend.cpus.usable_cpus`)."""
    one = min(os.sched_getaffinity(0))
    code = ("from backend.cpus import usable_cpus; from proxy.cli import serve_config; "
            "c = serve_config(['-t', '-1', '-tb', '-1']); "
            "print(usable_cpus(), c.threads, c.threads_batch)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(ROOT),
                         capture_output=True, text=True, timeout=60,
                         preexec_fn=lambda: os.sched_setaffinity(0, {one}))
    assert out.stdout.split() == ["1", "1", "1"], out.stderr
