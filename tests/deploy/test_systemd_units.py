"""deploy/systemd/: the hardened units as systemd reads them, and the daemons run by the
units' own command lines under the part of the sandbox a test can apply without systemd.

- ``systemd-analyze verify`` accepts each unit, rendered as install-skymesh.sh renders it
  (paths rewritten to a prefix whose scripts exist).
- ``systemd-analyze security --offline=true`` scores each unit's exposure (0 = locked down,
  10 = nothing restricted); each stays at or under ``CEILING``. The scores are printed
  (``pytest -s``). Before this hardening pass the three units scored 3.2.
- ``MemoryDenyWriteExecute=yes`` is only safe if nothing in the process maps writable
  executable memory. The kernel's own form of the rule, ``PR_SET_MDWE`` (Linux 6.3+,
  inherited across fork and exec), is applied to a replica, two balancers peered over
  mTLS and a controller started with the units' ExecStart; they must serve, peer and
  answer, and the balancer's ExecReload must re-read its config.

Skipped with the reason where systemd-analyze or PR_SET_MDWE is missing.
"""

from __future__ import annotations

import configparser
import ctypes
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from controller_support import token_config
from support import http_call as call
from support import wait_for as wait

from skymesh.mesh import certs
from skymesh.util.procs import free_port

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "deploy" / "systemd"
ROLES = ("lb", "replica", "controller")
# Exposure ceiling per unit. The rest of the score is the network (a server needs
# AF_INET, a host network and no IP allow list: its clients are anywhere) and running in
# the host's root directory.
CEILING = 1.5
# What the brief and docs/deploy.md promise of every unit.
REQUIRED = {
    "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
    "NoNewPrivileges": "yes", "CapabilityBoundingSet": "", "MemoryDenyWriteExecute": "yes",
    "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX", "StateDirectory": "skymesh",
    "Restart": "on-failure", "User": "skymesh",
}
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
# Runs argv[1:] with PR_SET_MDWE(PR_MDWE_REFUSE_EXEC_GAIN) set: exit 3 where the kernel
# has no such prctl (before 6.3).
MDWE_EXEC = ("import ctypes, os, sys\n"
             "if ctypes.CDLL(None, use_errno=True).prctl(65, 1, 0, 0, 0) != 0:\n"
             "    sys.stderr.write('PR_SET_MDWE: ' + os.strerror(ctypes.get_errno()))\n"
             "    sys.exit(3)\n"
             "os.execv(sys.argv[1], sys.argv[1:])\n")


def read_unit(path: Path) -> configparser.ConfigParser:
    # Repeated keys (SystemCallFilter=, Environment=) accumulate in systemd: keep them all.
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string(path.read_text())
    return unit


def analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        pytest.skip("systemd-analyze is not on PATH (Debian: apt-get install systemd); the "
                    "units are then checked only by tests/deploy/test_deploy_artifacts.py")
    return path


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The units with /opt/skymesh/ and /etc/skymesh/ rewritten, as install-skymesh.sh
    does, to a prefix whose venv/bin holds this checkout's scripts."""
    tmp = tmp_path_factory.mktemp("units")
    bin_dir = tmp / "opt" / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (tmp / "etc").mkdir()
    for role in ROLES:
        script = Path(sys.executable).with_name(f"skymesh-{role}")
        assert script.exists(), f"{script}: the venv has no skymesh-{role} script"
        (bin_dir / f"skymesh-{role}").symlink_to(script)
    out = {}
    for role in ROLES:
        text = (UNITS / f"skymesh-{role}.service").read_text()
        text = text.replace("/opt/skymesh/", f"{tmp}/opt/").replace("/etc/skymesh/",
                                                                       f"{tmp}/etc/")
        out[role] = tmp / f"skymesh-{role}.service"
        out[role].write_text(text)
    return out


@pytest.mark.parametrize("role", ROLES)
def test_units_promise_the_sandbox(role: str) -> None:
    unit = read_unit(UNITS / f"skymesh-{role}.service")
    svc = unit["Service"]
    for key, value in REQUIRED.items():
        assert svc.get(key) == value, f"skymesh-{role}.service: {key}={svc.get(key)}"
    text = (UNITS / f"skymesh-{role}.service").read_text()
    filters = re.findall(r"^SystemCallFilter=(.*)$", text, re.M)
    assert filters[0] == "@system-service" and "~@privileged" in filters[1], filters
    # A crash loop ends (the unit fails, the health check replaces the host) instead of
    # spinning forever, and not before a few restarts.
    assert int(unit["Unit"]["StartLimitBurst"]) >= 5
    reload = svc.get("ExecReload")
    if role == "lb":
        assert reload == "/bin/kill -HUP $MAINPID"
    else:  # only the balancer re-reads its config on SIGHUP; others would die of it
        assert reload is None


def test_systemd_analyze_verify_accepts_the_units(rendered: dict[str, Path]) -> None:
    proc = subprocess.run([analyze(), "verify", "--man=no", *map(str, rendered.values())],
                          capture_output=True, text=True, timeout=60)
    # Unknown keys and bad values are only warnings to systemd: any output is a finding.
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), proc.stderr


def exposure(analyze_bin: str, unit: Path) -> float:
    proc = subprocess.run([analyze_bin, "security", "--offline=true", "--no-pager", str(unit)],
                          capture_output=True, text=True, timeout=60)
    found = re.search(r"Overall exposure level for \S+: ([\d.]+)", proc.stdout)
    assert found, proc.stdout[-2000:] + proc.stderr
    return float(found.group(1))


def test_exposure_scores_stay_under_the_ceiling(rendered: dict[str, Path]) -> None:
    bin_ = analyze()
    scores = {role: exposure(bin_, path) for role, path in rendered.items()}
    print("systemd-analyze security --offline=true:",
          ", ".join(f"skymesh-{r} {s:.1f}" for r, s in scores.items()))
    over = {r: s for r, s in scores.items() if s > CEILING}
    assert not over, f"exposure above {CEILING}: {over}"


# -- the daemons under MemoryDenyWriteExecute ------------------------------------------------


def mdwe_supported() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(66, 0, 0, 0, 0) < 0:  # PR_GET_MDWE
        pytest.skip(f"this kernel ({os.uname().release}) has no PR_SET_MDWE (Linux 6.3+): "
                    "MemoryDenyWriteExecute= cannot be tried without systemd")






@dataclass
class Proc:
    proc: subprocess.Popen[bytes]
    log: Path
    url: str = ""
    config: Path | None = None

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def exec_start(unit: Path, env: dict[str, str] | None = None) -> list[str]:
    words = []
    for word in shlex.split(read_unit(unit)["Service"]["ExecStart"]):
        words += env[word[1:]].split() if word.startswith("$") and env else [word]
    return words


def start_mdwe(words: list[str], log: Path) -> Proc:
    """``words`` under PR_SET_MDWE, output to ``log`` (see :func:`listening`)."""
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", MDWE_EXEC, *words], stdout=out,
                                stderr=subprocess.STDOUT)
    return Proc(proc, log)


def listening(p: Proc) -> None:
    """Wait for ``p``'s 'listening on URL' line; its URL then in ``p.url``."""
    def bound() -> bool:
        assert p.proc.poll() is None, f"exited {p.proc.returncode}:\n{p.text()[-3000:]}"
        m = re.search(r"listening on (http://\S+)", p.text())
        p.url = m.group(1) if m else ""
        return bool(m)

    wait(bound, f"{p.log.stem} listening", timeout=90)


@pytest.fixture
def mdwe_stack(rendered: dict[str, Path], tmp_path: Path) -> Iterator[dict[str, Proc]]:
    mdwe_supported()
    procs: dict[str, Proc] = {}
    try:
        # All four start at once (start-up is mostly imports): ports picked beforehand.
        replica_port = free_port()
        procs["replica"] = start_mdwe(
            [exec_start(rendered["replica"])[0], "--port", str(replica_port),
             "--host", "127.0.0.1", "--time-scale", "0.05"], tmp_path / "replica.log")
        pki = tmp_path / "pki"
        certs.create_ca(pki)
        ports = {"lb-a": free_port(), "lb-b": free_port()}
        for me, peer in (("lb-a", "lb-b"), ("lb-b", "lb-a")):
            certs.issue_cert(pki, me)
            cfg = tmp_path / f"{me}.yaml"
            cfg.write_text(yaml.safe_dump({
                "region": me, "listen": {"port": 0},
                "replicas": [{"url": f"http://127.0.0.1:{replica_port}"}],
                "mesh": {"id": me, "certs_dir": str(pki), "listen_port": ports[me],
                         "heartbeat_interval_s": 0.1,
                         "peers": [{"id": peer, "address": f"127.0.0.1:{ports[peer]}"}]}}))
            words = exec_start(rendered["lb"])
            words[words.index("--config") + 1] = str(cfg)
            procs[me] = start_mdwe(words, tmp_path / f"{me}.log")
            procs[me].config = cfg
        cfg = tmp_path / "controller.yaml"
        cfg.write_text(yaml.safe_dump({"listen": {"host": "127.0.0.1", "port": 0},
                                       "tokens": token_config()}))
        words = exec_start(rendered["controller"])
        words[words.index("--config") + 1] = str(cfg)
        procs["controller"] = start_mdwe(words, tmp_path / "controller.log")
        for p in procs.values():
            listening(p)
        yield procs
    finally:
        for p in procs.values():
            if p.proc.poll() is None:
                p.proc.terminate()
                try:
                    p.proc.wait(20)
                except subprocess.TimeoutExpired:
                    p.proc.kill()
                    p.proc.wait()


def test_the_mdwe_wrapper_really_refuses_writable_executable_memory() -> None:
    mdwe_supported()
    probe = ("import mmap\n"
             "mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n")
    proc = subprocess.run([sys.executable, "-c", MDWE_EXEC, sys.executable, "-c", probe],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "PermissionError" in proc.stderr, proc.stderr
    free = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=60)
    assert free.returncode == 0  # the refusal is the prctl's, not this machine's


def test_daemons_serve_peer_and_reload_under_memory_deny_write_execute(
        mdwe_stack: dict[str, Proc], rendered: dict[str, Path]) -> None:
    lb, ctl = mdwe_stack["lb-a"], mdwe_stack["controller"]
    wait(lambda: call(lb.url + "/ready")[0] == 200, "lb-a sees the replica")

    def peer_alive() -> bool:
        status, body = call(lb.url + "/status")
        peers = json.loads(body)["mesh"]["peers"] if status == 200 else []
        return bool(peers) and all(p["liveness"] == "alive" for p in peers)

    wait(peer_alive, "lb-a hears lb-b over mTLS gRPC")
    chat = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    status, body = call(lb.url + "/v1/chat/completions", chat)
    assert status == 200, body
    assert json.loads(body)["choices"][0]["message"]["content"]
    assert call(ctl.url + "/health")[0] == 200
    status, _ = call(ctl.url + "/v1/regions")
    assert status == 401  # the admin API is up behind its tokens

    # ExecReload, with $MAINPID as systemd fills it in: the edited file is applied live.
    cfg_path = lb.config
    assert cfg_path is not None
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["policy"] = {"name": "round-robin", "params": {}}
    cfg_path.write_text(yaml.safe_dump(cfg))
    reload = read_unit(rendered["lb"])["Service"]["ExecReload"]
    words = shlex.split(reload.replace("$MAINPID", str(lb.proc.pid)))
    assert subprocess.run(words, timeout=30).returncode == 0
    wait(lambda: "SIGHUP: reloaded" in lb.text(), "lb-a logs the reload")
    assert re.search(r"SIGHUP: reloaded .*applied: policy", lb.text()), lb.text()[-2000:]
    assert lb.proc.poll() is None
    for name, p in mdwe_stack.items():
        assert p.proc.poll() is None, f"{name} died:\n{p.text()[-2000:]}"
    # SIGTERM (systemd's stop) ends each one cleanly.
    for name, p in mdwe_stack.items():
        p.proc.send_signal(signal.SIGTERM)
        assert p.proc.wait(30) == 0, f"{name} exit {p.proc.returncode}:\n{p.text()[-2000:]}"
