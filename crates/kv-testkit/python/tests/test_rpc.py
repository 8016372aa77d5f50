"""rpc.serve's one-way requests (no reply, an error owed to the next request) and its after-reply hook (no torch)."""

import contextlib
import gc
import multiprocessing as mp
import os
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpu_serving import rpc  # noqa: E402


class Handler:
    ONE_WAY_OPS = ("stage",)

    def __init__(self):
        self.staged = None

    def op_stage(self, prompt):
        if not prompt:
            raise ValueError("empty prompt")
        self.staged = prompt
        return {}

    def op_take(self):
        got, self.staged = self.staged, None
        return {"prompt": got}


class AfterHandler(Handler):
    """Records, in ``after_reply``, each op whose reply went out; fails after ``boom``."""

    def __init__(self):
        super().__init__()
        self.after = []

    def op_boom(self):
        return {}

    def op_after(self):
        return {"after": list(self.after)}

    def after_reply(self, op):
        self.after.append(op)
        if op == "boom":
            raise RuntimeError("after boom")


@contextlib.contextmanager
def serving(handler=None):
    """A ``Worker`` whose call / send go over a pipe to ``rpc.serve`` on a thread (no process).

    The body must end the serve loop (``exit``); afterwards the thread has
    stopped and the collector is back as ``serve`` found it.
    """
    client, server = mp.Pipe()
    t = threading.Thread(target=rpc.serve, args=(server, handler or Handler()), daemon=True)
    t.start()
    w = rpc.Worker.__new__(rpc.Worker)
    w.conn, w.totals_ms = client, {}
    try:
        yield w
    finally:
        t.join(5)
        gc.unfreeze()
        gc.enable()
    assert not t.is_alive()


def test_one_way_requests_get_no_reply_and_an_error_answers_the_next_request():
    with serving() as w:
        assert w.send("stage", prompt=[1, 2]) >= 0.0
        assert not w.conn.poll(0.2)  # nothing came back for the one-way request
        assert w.call("take")[0] == {"prompt": [1, 2]}
        w.send("stage", prompt=[])  # raises in the worker: owed to the next request
        try:
            w.call("take")
            raise AssertionError("the stage error was not reported")
        except rpc.WorkerError as e:
            assert "stage (one-way, before this request)" in str(e) and "empty prompt" in str(e)
        # The failed request was answered with the error, not run; the next one runs.
        assert w.call("take")[0] == {"prompt": None}
        assert set(w.totals_ms) == {"stage", "take"}
        w.conn.send({"op": "exit"})
        assert w.conn.recv() == {"ok": True}


def test_a_two_way_op_sent_one_way_is_refused_without_a_reply_and_exit_reports_a_pending_error():
    with serving() as w:
        # "take" answers: sent one-way, a reply would pair with the next call.
        w.send("take")
        assert not w.conn.poll(0.2)
        try:
            w.call("take")
            raise AssertionError("the refused one-way request was not reported")
        except rpc.WorkerError as e:
            assert "sent one-way" in str(e)
        w.send("stage", prompt=[7])
        assert w.call("take")[0] == {"prompt": [7]}  # replies pair with their requests again
        w.send("stage", prompt=[])  # fails; the worker exits before another request
        w.conn.send({"op": "exit"})
        got = w.conn.recv()
        assert got["ok"] is False and "empty prompt" in got["error"]


def test_after_reply_runs_after_each_reply_and_its_error_answers_the_next_request():
    with serving(AfterHandler()) as w:
        w.send("stage", prompt=[1])  # one-way: no reply, so no after_reply
        assert w.call("take")[0] == {"prompt": [1]}
        # The reply to "after" was built before its own after_reply ran.
        assert w.call("after")[0] == {"after": ["take"]}
        assert w.call("boom")[0] == {}  # its reply went out; the hook then failed
        try:
            w.call("after")
            raise AssertionError("the after_reply error was not reported")
        except rpc.WorkerError as e:
            assert "after_reply(boom)" in str(e) and "after boom" in str(e)
        # That request was answered with the error, not run; the next one runs.
        assert w.call("after")[0] == {"after": ["take", "after", "boom"]}
        w.conn.send({"op": "exit"})
        assert w.conn.recv() == {"ok": True}
