"""Engine processes of the vLLM tests (test_vllm.py, test_vllm_kv.py): start one, read its
RESULT lines (its other output is vLLM's log), end it; and EngineHost, one process that runs
engines one after another (tests/python/vllm_engine.py --serve)."""

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading


def serve(run_one):
    """The engine side of EngineHost (an engine script's --serve): one engine after another in
    this process, each asked for by a JSON line on stdin and answered by a RESULT line;
    run_one(request) starts it and returns (the LLM, its answer). An engine with "hold" stays
    alive until the next line; {"release": true} only ends it. An engine that fails answers
    {"error": ...} and the process exits with 3 (vLLM's state in it is not usable after an
    engine failed while it started; EngineHost starts another process for the next one)."""
    import gc
    import traceback
    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    def end():
        gc.collect()  # the engine's finalizer shuts its workers (and KV connector) down
        cleanup_dist_env_and_memory()
        ensure_kv_transfer_shutdown()  # the next engine makes its own connector

    held = None
    for line in sys.stdin:
        request = json.loads(line)
        if held is not None:
            held = None
            end()
        if request.get("release"):
            print("RESULT " + json.dumps({"released": True}), flush=True)
            continue
        try:
            llm, result = run_one(request)
        except Exception as e:
            traceback.print_exc()
            print("RESULT " + json.dumps({"error": "%s: %s" % (type(e).__name__, e)}),
                  flush=True)
            sys.exit(3)
        if request.get("hold"):
            held = llm
        del llm
        if held is None:
            end()
        print("RESULT " + json.dumps(result), flush=True)


def start(args, env, prefix=()):
    """An engine process (a process group of its own: killpg reaches its workers) whose stdout
    a thread reads to its end, so that the pipe never fills and no line waits in a buffer
    select() cannot see; its RESULT lines go to p.answers, its stderr to p.err_file. prefix:
    what runs the interpreter (["ip", "netns", "exec", NAME]: in a network namespace)."""
    err = tempfile.TemporaryFile()
    p = subprocess.Popen(list(prefix) + [sys.executable] + args, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                         process_group=0)
    p.err_file = err
    p.answers = queue.Queue()
    threading.Thread(target=_read_answers, args=(p.stdout, p.answers), daemon=True).start()
    return p


def _read_answers(stdout, answers):
    for line in stdout:
        if line.startswith("RESULT "):
            answers.put(json.loads(line[len("RESULT "):]))
    answers.put(None)


def log(p, tail=6000):
    """The last `tail` characters of the engine's stderr (vLLM's log, tracebacks); all of it
    with tail=None."""
    text = _read_from(p.err_file, 0)
    return text if tail is None else text[-tail:]


def _read_from(err_file, offset):
    """The engine's stderr from `offset`, by pread: the engine writes through the same open
    file, whose offset a seek here would move under its writes."""
    fd = err_file.fileno()
    return os.pread(fd, max(0, os.fstat(fd).st_size - offset), offset).decode(errors="replace")


def answer(p, timeout=240):
    """The engine's next RESULT; an engine silent for `timeout` s is killed."""
    try:
        result = p.answers.get(timeout=timeout)
    except queue.Empty:
        os.killpg(p.pid, signal.SIGKILL)
        raise AssertionError("no answer from the engine in %d s:\n%s" % (timeout, log(p)))
    if result is None:
        raise AssertionError("the engine exited (%s) without an answer:\n%s"
                             % (p.wait(), log(p)))
    return result


def finish(p, timeout=60):
    """Closes the engine's stdin (a held engine exits) and waits for it."""
    try:
        p.stdin.close()
    except OSError:
        pass
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise AssertionError("the engine did not exit in %d s:\n%s" % (timeout, log(p)))


class EngineHost:
    """One process that starts vLLM engines one after another (vllm_engine.py --serve): each
    engine is a whole LLM of its own, built, run and deleted, but vLLM's import (most of an
    engine's start on 2 cores) is paid once. Two hosts stand for two engine processes: a
    builder in one and an attacher in the other see the arena as two engines do."""

    def __init__(self, engine_script, env, prefix=()):
        self.script, self.env, self.prefix = engine_script, env, prefix
        self.p = start([engine_script, "--serve"], env, prefix)

    def run(self, *args, timeout=240, **kwargs):
        """One engine's answer; with hold=True it stays alive until release() or the next
        run(). An engine that failed raises AssertionError with its error and the log."""
        self.submit(*args, **kwargs)
        return self.result(timeout)

    def submit(self, model_dir, load_format, arena_dir, dtype="float32", hold=False,
               offload_gb=0, compile=False, hf_overrides=None, prompt_len=None,
               loader_options=None, engine=None):
        """Starts a vllm_engine.py engine and returns at once (result() waits for its answer):
        engines of two hosts submitted together start at the same time. loader_options: more
        of the expert_arena loader's --model-loader-extra-config. engine: more LLM() arguments
        (over vllm_families.ENGINE_ARGS)."""
        self.send(dict(model_dir=model_dir, load_format=load_format, arena_dir=arena_dir,
                       dtype=dtype, tp=1, offload=offload_gb, compile=compile, fail=None,
                       overrides=hf_overrides, prompt_len=prompt_len or 5, hold=hold,
                       loader_options=loader_options, engine=engine))

    def result(self, timeout=240):
        result = answer(self.p, timeout)
        if "error" in result:
            # serve() exits after a failed engine: waited for, so that the next request starts
            # a new process instead of going into this one while it exits (and being lost).
            self.p.wait(timeout=120)
            raise AssertionError("the engine failed: %s\n%s" % (result["error"], log(self.p)))
        return result

    def attempt(self, *args, **kwargs):
        """Like run(), but a failed engine's answer ({"error": ...}) is returned (the next
        engine then starts in a new process)."""
        try:
            return self.run(*args, **kwargs)
        except AssertionError as e:
            return {"error": str(e)}

    def release(self, timeout=240):
        """Ends the held engine (if any). An answer still due (an engine submitted whose
        result() was not read, as when another host's engine failed) is read first."""
        if self.p.poll() is not None:
            return
        self.send({"release": True})
        while not answer(self.p, timeout).get("released"):
            pass

    @property
    def pid(self):
        return self.p.pid

    def log_mark(self):
        """Where the host's log ends now: log_since(mark) is what the engines after it wrote."""
        return self.p, os.fstat(self.p.err_file.fileno()).st_size

    def log_since(self, mark):
        p, offset = mark
        return _read_from(self.p.err_file, offset if p is self.p else 0)  # 0: started again

    def send(self, request):
        """Starts an engine from the request (the engine script's own form) and returns at
        once; result() reads its answer."""
        if self.p.poll() is not None:
            # It exited after an engine failed (serve()): a new process for the next one.
            assert self.p.returncode == 3, "the engine host exited (%s):\n%s" % (
                self.p.returncode, log(self.p))
            self.p = start([self.script, "--serve"], self.env, self.prefix)
        self.p.stdin.write(json.dumps(request) + "\n")
        self.p.stdin.flush()

    def close(self):
        return finish(self.p, timeout=120)


@contextlib.contextmanager
def held_together(hosts, model_dirs, *args, **kwargs):
    """Engines started at the same time, one in each host (on model_dirs[i]; the rest as
    EngineHost.submit takes it), alive while the with-block runs: yields their answers, in the
    hosts' order, and ends them after it (also when an answer was an error)."""
    try:
        for host, model_dir in zip(hosts, model_dirs):
            host.submit(model_dir, *args, hold=True, **kwargs)
        yield [host.result() for host in hosts]
    finally:
        for host in hosts:
            host.release()


def run_together(hosts, model_dirs, *args, **kwargs):
    """held_together's answers, the engines ended."""
    with held_together(hosts, model_dirs, *args, **kwargs) as results:
        return results
