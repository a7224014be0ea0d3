"""Shared plumbing of the GPU examples and tests: the daemon, worker
processes (multiprocessing spawn), JSON messages over pipes (no pickle of
our own data), a small Qwen3/Llama-style transformers model, greedy
decoding and parameter digests."""

import hashlib
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "client", "python"))


def fail(msg):
    print(f"FAIL {msg}", flush=True)


class Checks:
    """check(cond, what) prints a PASS/FAIL line; finish(name) prints the
    verdict and returns the exit code."""

    def __init__(self):
        self.ok = True

    def __call__(self, cond, what):
        print(f"{'PASS' if cond else 'FAIL'} {what}", flush=True)
        self.ok = self.ok and bool(cond)

    def finish(self, name):
        print(f"{name}:", "PASS" if self.ok else "FAIL", flush=True)
        return 0 if self.ok else 1


def binaries(argv):
    """(weightsyncd, weightsync_gpu_worker) from argv[1:3] or the env."""
    d = argv[1] if len(argv) > 1 else os.environ.get("WEIGHTSYNCD", "")
    w = argv[2] if len(argv) > 2 else os.environ.get("WEIGHTSYNC_GPU_WORKER", "")
    if d and os.path.isdir(d):
        d, w = os.path.join(d, "weightsyncd"), w or os.path.join(d, "weightsync_gpu_worker")
    if not w and d:
        w = os.path.join(os.path.dirname(d), "weightsync_gpu_worker")
    for what, p in (("weightsyncd", d), ("weightsync_gpu_worker", w)):
        if not p or not os.path.exists(p):
            sys.exit(f"usage: {argv[0]} [WEIGHTSYNCD [WEIGHTSYNC_GPU_WORKER]] (or a folder "
                     f"holding both, or env WEIGHTSYNCD / WEIGHTSYNC_GPU_WORKER): no {what} "
                     f"at {p!r}")
    return os.path.abspath(d), os.path.abspath(w)


class Daemon:
    """weightsyncd on a Unix socket in a temp dir, its NCCL rank on `gpu`."""

    def __init__(self, daemon, worker, gpu=1, extra=(), log_dir=None, timeout_s=900):
        self.dir = tempfile.mkdtemp(prefix="ws-py.", dir="/tmp")
        self.sock = os.path.join(self.dir, "d.sock")
        log_dir = log_dir or os.environ.get("WS_LOG_DIR") or self.dir
        os.makedirs(log_dir, exist_ok=True)
        self.log_path = os.path.join(log_dir, f"daemon-{os.getpid()}.log")
        self.log = open(self.log_path, "w")
        cmd = ["timeout", str(timeout_s), daemon, f"--socket={self.sock}", f"--gpu={gpu}",
               f"--gpu_worker={worker}", "--notice_timeout_ms=60000",
               "--finish_timeout_ms=120000", *extra,
               # Experiments: more daemon flags from the environment.
               *os.environ.get("WS_DAEMON_EXTRA", "").split()]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        for _ in range(200):
            if os.path.exists(self.sock):
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"weightsyncd exited ({self.proc.returncode}); see "
                                   f"{self.log_path}")
            time.sleep(0.05)
        else:
            raise RuntimeError(f"weightsyncd did not listen on {self.sock}")
        self.target = "unix:" + self.sock

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def send(conn, obj):
    conn.send_bytes(json.dumps(obj).encode())


def recv(conn, timeout, what="a message"):
    if not conn.poll(timeout):
        raise TimeoutError(f"no {what} within {timeout:.0f} s")
    msg = json.loads(conn.recv_bytes().decode())
    if isinstance(msg, dict) and msg.get("error"):
        raise RuntimeError(f"worker failed: {msg['error']}")
    return msg


class Worker:
    """A spawned process running `fn(conn, *args)`; fn reports over the pipe
    and ends itself with os._exit (torch/NCCL teardown can hang)."""

    def __init__(self, fn, *args):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_run, args=(fn, child) + args, daemon=True)
        self.proc.start()
        child.close()

    def send(self, obj):
        send(self.conn, obj)

    def recv(self, timeout, what="a message"):
        try:
            return recv(self.conn, timeout, what)
        except (EOFError, OSError):
            raise RuntimeError(f"worker exited ({self.proc.exitcode}) while waiting for {what}")

    def stop(self):
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def _run(fn, conn, *args):
    import traceback
    try:
        fn(conn, *args)
        code = 0
    except BaseException as e:  # report, then leave without teardown
        traceback.print_exc()
        try:
            send(conn, {"error": f"{type(e).__name__}: {e}"})
        except Exception:
            pass
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# -- the model -----------------------------------------------------------------

def deterministic():
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def small_config(tie=False):
    """A small Qwen3-style config (Llama-style if this transformers has no
    Qwen3), random weights, no downloads."""
    kw = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              tie_word_embeddings=tie)
    try:
        from transformers import Qwen3Config
        cfg = Qwen3Config(head_dim=64, **kw)
    except ImportError:
        from transformers import LlamaConfig
        cfg = LlamaConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def build_model(cfg, seed, device, dtype_name="bfloat16"):
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    except TypeError:
        model = AutoModelForCausalLM.from_config(cfg)
    return model.to(device=device, dtype=getattr(torch, dtype_name)).eval()


def train_step(model, cfg, seed, lr=1e-2):
    """One optimizer step on a next-token loss over random tokens."""
    import torch
    g = torch.Generator(device="cpu").manual_seed(seed)
    dev = next(model.parameters()).device
    ids = torch.randint(0, cfg.vocab_size, (4, 32), generator=g).to(dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
    torch.cuda.synchronize(dev)
    return float(loss)


def greedy(model, prompt, n, between_tokens=None):
    """Greedy decoding without a KV cache (every step recomputes the whole
    sequence, so tokens after a weight change depend only on the prefix and
    the new weights). between_tokens(i) runs before token i."""
    import torch
    dev = next(model.parameters()).device
    ids = list(prompt)
    with torch.no_grad():
        for i in range(n):
            if between_tokens is not None:
                between_tokens(i)
            logits = model(input_ids=torch.tensor([ids], device=dev)).logits[0, -1]
            ids.append(int(torch.argmax(logits).item()))
    return ids[len(prompt):]


PROMPTS = [[1, 17, 33, 101, 7], [5, 900, 12], [42, 43, 44, 45, 46, 47, 48]]


def digests(named):
    """{name: sha256 of the tensor's bytes}."""
    import torch
    out = {}
    for name, t in named:
        t = t.detach().contiguous().reshape(-1)
        raw = t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16 if
                                                                         t.element_size() == 2
                                                                         else torch.int32)
        out[name] = hashlib.sha256(raw.cpu().numpy().tobytes()).hexdigest()
    return out


def compare_digests(engine, trainer):
    bad = [n for n in trainer if engine.get(n) != trainer[n]]
    missing = [n for n in engine if n not in trainer]
    return bad, missing
