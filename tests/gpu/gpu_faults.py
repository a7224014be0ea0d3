#!/usr/bin/env python3
"""The fault suite on GPUs (issue 6): the NCCL backend on two GPUs (trainer
on GPU 0, daemon and engines on GPU 1), or the IPC backend (ring of 2
slots) on one GPU. One command, on a device machine:

    python3 tests/gpu/gpu_faults.py BIN_DIR LOG_DIR [--json OUT] [--only FAULT,...]
        [--idle_timeout_ms MS|default] [--max_detect_s S]

--idle_timeout_ms: the daemon's --update_idle_timeout_ms (3000 unless
given; `default`: the flag is not passed, 5 min). --max_detect_s: a row
whose detection took longer fails (issue 36: a killed trainer is seen
through its Liveness stream within 1 s, not at the idle timeout).

BIN_DIR holds weightsyncd, weightsync_gpu_worker, weightsync_gpu_engine,
weightsync_gpu_trainer and weightsyncctl. For each fault x phase: a fresh
daemon, two engines (demo model, bf16, CUDA VMM memory, each verifying
every version it gets against the reference), and a trainer that stops
itself (SIGSTOP) at the phase: init (group formed, before Start), start
(after Start, before any byte), mid (after 3 chunks), finish (every chunk
sent, Finish not called), pause (group formed and engines paused by the
trainer's Pause, before Start). Then the
fault: trainer killed (SIGKILL), trainer frozen (it stays stopped), engine
b killed, daemon killed and restarted (engines re-register by themselves),
engine b freeing its memory under the daemon's import (engine_freed: VMM
memory; engine_freed_ipc: a legacy cudaIpc allocation) while it stays
connected.
Then, as tests/faults/faults.py on the host backend: detection (polling
`weightsyncctl status --json` until no update is receiving and no engine
is paused or updating; a hang is none within 30 s), the daemon alive,
every engine READY at v0 / v99 or DIRTY, and a new trainer's update v100
(receipts on) committed and verified bit for bit by every surviving
engine. (engine killed: the trainer goes on after the kill and its update
must complete on engine a alone, READY at v99.) Prints a table, exits 1 if a row fails. Every wait is bounded;
the driver kills what it started at the end of each case.
"""

import json
import os
import signal
import subprocess
import sys
import time

BIN, LOG = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
OUT = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
# --only FAULT[,FAULT...]: rerun some faults (every phase).
ONLY = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else None
IDLE_MS = sys.argv[sys.argv.index("--idle_timeout_ms") + 1] if "--idle_timeout_ms" in sys.argv \
    else "3000"
MAX_DETECT_S = float(sys.argv[sys.argv.index("--max_detect_s") + 1]) \
    if "--max_detect_s" in sys.argv else None
GPUS = len(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
           .stdout.strip().splitlines())
NCCL = GPUS >= 2
DEV = 1 if NCCL else 0       # daemon and engines
TRAINER_DEV = 0
CHUNK_MIB = 16               # the demo model (221 MB) in 14 chunks
# Where the trainer stops itself: before the first Start (init: the group
# formed; pause: the group formed and the engines paused by its Pause), or
# after this many chunks of its update (start: after Start, before any
# byte; mid; finish: every chunk sent, Finish not called).
PHASES = {"init": "init", "start": 0, "mid": 3, "finish": 1000, "pause": "pause"}
FAULTS = ["trainer_killed", "trainer_frozen", "engine_killed", "daemon_restarted",
          "engine_freed", "engine_freed_ipc"]
# engine_freed[_ipc]: engine b frees its parameters' memory (SIGUSR1: the
# VMM unmap + release + close, or cudaFree of its legacy-IPC allocation,
# which engine b then uses) under the daemon's import and stays connected;
# the trainer goes on. The daemon must live, engine a get v99 and v100
# verified. Engine b reports its memory gone at its next pause or resume
# (EngineHooks::check_memory, issue 30): the daemon unregisters it, and it
# must not be READY after the next update (b_not_ready).
FREED = ("engine_freed", "engine_freed_ipc")
DETECT_LIMIT_S = 30


class Case:
    def __init__(self, fault, phase):
        self.name = f"{fault}-{phase}"
        self.dir = os.path.join(LOG, self.name)
        os.makedirs(self.dir, exist_ok=True)
        os.chmod(self.dir, 0o750)
        self.sock = os.path.join(self.dir, "d.sock")
        self.procs = []

    def spawn(self, name, args):
        p = subprocess.Popen(args, stdout=open(os.path.join(self.dir, name + ".log"), "a"),
                             stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def log(self, name):
        try:
            return open(os.path.join(self.dir, name + ".log")).read()
        except OSError:
            return ""

    def daemon(self):
        d = self.spawn("daemon", [os.path.join(BIN, "weightsyncd"), f"--socket={self.sock}",
                                  f"--gpu={DEV}",
                                  f"--gpu_worker={os.path.join(BIN, 'weightsync_gpu_worker')}",
                                  "--notice_timeout_ms=10000",
                                  "--finish_timeout_ms=15000", f"--max_chunk_bytes={1 << 30}"] +
                          ([] if IDLE_MS == "default" else [f"--update_idle_timeout_ms={IDLE_MS}"]))
        for _ in range(300):
            if os.path.exists(self.sock):
                break
            time.sleep(0.05)
        return d

    def engine(self, eid, memory="vmm"):
        # Not under `timeout`: the fault is sent to this very process (the
        # driver kills everything it started when the case ends).
        return self.spawn(f"engine-{eid}", [
            os.path.join(BIN, "weightsync_gpu_engine"), f"--target=unix:{self.sock}",
            f"--engine_id={eid}", "--model=demo", "--layout=plain", "--dtype=bfloat16",
            "--ckpt_dtype=bfloat16", f"--device={DEV}", f"--memory={memory}", "--verify=true"])

    def trainer(self, name, version, stall=-1):
        args = [os.path.join(BIN, "weightsync_gpu_trainer"), f"--target=unix:{self.sock}",
                f"--device={TRAINER_DEV}", "--model=demo", "--dtype=bfloat16", "--updates=1",
                f"--first_version={version}", f"--chunk_mib={CHUNK_MIB}", "--receipts=true",
                "--finish_timeout_ms=30000", "--update_timeout_s=90"]
        args.append(f"--stall_phase={stall}" if isinstance(stall, str)
                    else f"--stall_after_chunks={stall}")
        if not NCCL:
            args += ["--backend=ipc", "--ipc_ring_slots=2"]
        return self.spawn(name, args)

    def status(self):
        try:
            r = subprocess.run([os.path.join(BIN, "weightsyncctl"), f"--socket={self.sock}",
                                "--json", "status"], capture_output=True, text=True, timeout=10)
        except subprocess.TimeoutExpired:
            return None
        return json.loads(r.stdout) if r.returncode == 0 else None

    def stop(self):
        for p in reversed(self.procs):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass


def stopped(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def run_case(fault, phase):
    c = Case(fault, phase)
    row = dict(fault=fault, phase=phase, ok=False)
    try:
        daemon = c.daemon()
        engines = {e: c.engine(e, "ipc" if fault == "engine_freed_ipc" and e == "b" else "vmm")
                   for e in ("a", "b")}
        end = time.time() + 120
        while time.time() < end and not all("registered" in c.log(f"engine-{e}") for e in engines):
            time.sleep(0.1)
        trainer = c.trainer("trainer", 99, stall=PHASES[phase])
        end = time.time() + 60
        while time.time() < end and not stopped(trainer.pid):
            if trainer.poll() is not None:
                raise RuntimeError(f"the trainer exited before its phase: {c.log('trainer')[-400:]}")
            time.sleep(0.05)
        if not stopped(trainer.pid):
            raise RuntimeError("the trainer never reached its phase")
        t0 = time.time()
        if fault == "trainer_killed":
            trainer.send_signal(signal.SIGKILL)
        elif fault == "engine_killed":
            # The trainer is healthy: it goes on, and its update must
            # complete on engine a alone.
            engines["b"].send_signal(signal.SIGKILL)
            time.sleep(0.5)
            trainer.send_signal(signal.SIGCONT)
        elif fault in FREED:
            engines["b"].send_signal(signal.SIGUSR1)
            end = time.time() + 10
            while time.time() < end and "freed its" not in c.log("engine-b"):
                time.sleep(0.05)
            row["freed"] = "".join(l for l in c.log("engine-b").splitlines(True)
                                   if "freed its" in l).strip()
            trainer.send_signal(signal.SIGCONT)
        elif fault == "daemon_restarted":
            daemon.send_signal(signal.SIGKILL)
            daemon.wait()
            daemon = c.daemon()
        # trainer_frozen: it stays stopped; only a deadline can see it.
        detected = None
        while time.time() - t0 < DETECT_LIMIT_S:
            st = c.status()
            if st is not None:
                engs = st.get("engines", [])
                # A freed engine b leaves at its next pause or resume.
                want = (1,) if fault == "engine_killed" else (1, 2) if fault in FREED else (2,)
                busy = (st.get("update", {}).get("phase") == "receiving" or
                        any(e["state"] in ("ENGINE_PAUSED", "ENGINE_UPDATING") for e in engs) or
                        len(engs) not in want or not all(e.get("connected") for e in engs))
                if not busy:
                    detected = time.time() - t0
                    break
            time.sleep(0.05)
        row["detect_s"] = None if detected is None else round(detected, 2)
        row["hang"] = detected is None
        row["daemon_alive"] = daemon.poll() is None
        st = c.status() or {}
        row["states"] = {e["engine_id"]: f"{e['state'][7:]}@v{e['version']}"
                         for e in st.get("engines", [])}
        row["states_ok"] = bool(st) and all(
            e["state"] in ("ENGINE_READY", "ENGINE_DIRTY") and int(e["version"]) in (0, 99)
            for e in st.get("engines", []))
        if fault == "engine_killed" or fault in FREED:
            # The trainer's update runs after the detection (at init and
            # pause it has not started yet): judge the states once it ended.
            trainer.wait(60)
            row["trainer_saw"] = c.log("trainer").strip().splitlines()[-1:]
            st = c.status() or {}
            row["states"] = {e["engine_id"]: f"{e['state'][7:]}@v{e['version']}"
                             for e in st.get("engines", [])}
            row["states_ok"] &= row["states"].get("a") == "READY@v99" and (
                fault in FREED or row["states"] == {"a": "READY@v99"})
        # The frozen trainer (killed now) was holding rank 0 of the old
        # NCCL group: a new trainer forms a new one.
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                trainer.send_signal(sig)
            except ProcessLookupError:
                pass
        trainer.wait(10)
        nxt = c.trainer("trainer-next", 100)
        rc = nxt.wait(120)
        survivors = ["a"] if fault == "engine_killed" or fault in FREED else ["a", "b"]
        end = time.time() + 30
        while time.time() < end and not all(
                "version 100: verified" in c.log(f"engine-{e}") for e in survivors):
            time.sleep(0.1)
        row["next_update"] = rc == 0 and all(
            "version 100: verified" in c.log(f"engine-{e}") for e in survivors)
        row["mismatch"] = any("MISMATCH" in c.log(f"engine-{e}") for e in ("a", "b"))
        if fault in FREED:
            st = c.status() or {}
            row["after_next"] = {e["engine_id"]: f"{e['state'][7:]}@v{e['version']}"
                                 for e in st.get("engines", [])}
            row["b_saw"] = [l for l in c.log("engine-b").splitlines()
                            if "version" in l or "dirty" in l][-3:]
            row["b_not_ready"] = not row["after_next"].get("b", "gone").startswith("READY")
        row["ok"] = (not row["hang"] and row["daemon_alive"] and row["states_ok"] and
                     row["next_update"] and not row["mismatch"] and row.get("b_not_ready", True))
        if MAX_DETECT_S is not None and not row["hang"] and row["detect_s"] > MAX_DETECT_S:
            row["ok"] = False
            row["error"] = f"detection took {row['detect_s']} s > {MAX_DETECT_S} s"
        row["liveness"] = "".join(l for l in c.log("trainer").splitlines(True)
                                  if "liveness" in l).strip()[-80:]
        if not row["next_update"]:
            row["error"] = f"next update rc {rc}: {c.log('trainer-next')[-300:]}"
    except Exception as ex:
        row["error"] = f"{type(ex).__name__}: {ex}"
    finally:
        c.stop()
        for f in os.listdir(c.dir):
            if f.endswith(".sock"):
                os.unlink(os.path.join(c.dir, f))
    return row


def main():
    os.makedirs(LOG, exist_ok=True)
    print(f"GPU fault suite: {'nccl, trainer GPU 0, daemon GPU 1' if NCCL else 'ipc ring, GPU 0'}"
          f"; commit {os.environ.get('COMMIT', '?')}; {GPUS} GPU(s); --update_idle_timeout_ms "
          f"{'not passed (default 300000)' if IDLE_MS == 'default' else IDLE_MS}"
          f"{f'; detection limit {MAX_DETECT_S} s' if MAX_DETECT_S else ''}", flush=True)
    rows = []
    for fault in FAULTS:
        if ONLY and fault not in ONLY:
            continue
        for phase in PHASES:
            r = run_case(fault, phase)
            rows.append(r)
            print(f"{fault:17s} {phase:7s} detect {str(r.get('detect_s')):>6s} s  hang "
                  f"{r.get('hang')!s:5s} daemon {r.get('daemon_alive')!s:5s} states "
                  f"{r.get('states')} next {r.get('next_update')} "
                  f"{'after ' + str(r['after_next']) + ' ' if 'after_next' in r else ''}"
                  f"{'PASS' if r['ok'] else 'FAIL ' + r.get('error', '')}", flush=True)
            if r.get("liveness"):
                print(f"    trainer: {r['liveness']}", flush=True)
    if OUT:
        with open(OUT, "w") as f:
            json.dump(dict(backend="nccl" if NCCL else "ipc", gpus=GPUS,
                           commit=os.environ.get("COMMIT"), rows=rows), f, indent=1)
    bad = [r for r in rows if not r["ok"]]
    print(f"GPU faults ({'nccl' if NCCL else 'ipc'}): {len(rows) - len(bad)} of {len(rows)} "
          f"cases pass, {sum(1 for r in rows if r.get('hang'))} hangs")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
