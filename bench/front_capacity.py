"""How many streamed tokens a second the front process carries: the real HTTP server and
tokenizer manager, with the scheduler and detokenizer replaced by a stand-in that answers at
a GPU's pace.

On a GPU the scheduler produces a decode step of 256 streams in ~7-12 ms, and every step
sends one event to every stream: 20-35k events a second that one Python thread (uvicorn's
loop with the tokenizer manager) must turn into SSE writes. A CPU cannot run a model that
fast, so this benchmark takes the model out: `StandInScheduler`, a test double of the
scheduler and the detokenizer together in its own process, takes the tokenized requests
from the front process's ZMQ socket and, every `--step-ms`, sends one `BatchStrOut` with one
token (`--token-text`) for every running request, finishing each after its `max_new_tokens`.
The front process is the one `launch_server` runs (`create_app` over a `TokenizerManager`,
under uvicorn), and `bench_serving` streams `/generate` from it (prompts as token ids: the
front process loads no tokenizer, and a prompt's tokenizing is per request, not per token).

Reported: the output tok/s the stand-in offered and the one the client saw, and the CPU
seconds per second and per token of the front process and of the client. A process at ~1 CPU
second per second is the bound.

    python -m bench.front_capacity --num-prompts 256 --output-len 256 --step-ms 10
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from typing import Any

from bench.serving_cpu import (
    add_stream_args,
    cpu_seconds,
    reported,
    stream_random,
    wait_until_healthy,
)

STARTUP_TIMEOUT_S = 120


class StandInScheduler:
    """Test double of the scheduler + detokenizer: every request runs at once and gains one
    token per step; nothing is computed."""

    def __init__(self, port_args: Any, step_s: float, token_text: str) -> None:
        import zmq

        from srt.utils.process import zmq_socket

        ctx = zmq.Context(1)
        self.inbox = zmq_socket(ctx, zmq.PULL, port_args.scheduler_input_ipc, bind=True)
        self.outbox = zmq_socket(ctx, zmq.PUSH, port_args.tokenizer_ipc, bind=False)
        self.step_s = step_s
        self.token_text = token_text
        # rid -> [prompt tokens, max new tokens, tokens produced]
        self.running: dict[str, list[int]] = {}

    def serve(self) -> None:
        from managers.io_struct import AbortReq, TokenizedGenerateReqInput

        next_step = time.perf_counter()
        while True:
            while self.inbox.poll(0):
                msg = self.inbox.recv_pyobj()
                if isinstance(msg, TokenizedGenerateReqInput):
                    wanted = msg.sampling_params.max_new_tokens or 1
                    self.running[msg.rid] = [len(msg.input_ids), wanted, 0]
                elif isinstance(msg, AbortReq):
                    self.running.pop(msg.rid, None)
            if self.running:
                self.step()
            else:
                self.inbox.poll(100)
            next_step += self.step_s
            pause = next_step - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            else:
                next_step = time.perf_counter()  # behind: do not try to catch up in a burst

    def step(self) -> None:
        from managers.io_struct import (
            BatchStrOut,
            DecodeOptions,
            ReqOutput,
            ReqStrOutput,
            finish_length,
        )

        outputs = []
        for rid, req in list(self.running.items()):
            prompt_tokens, wanted, req[2] = req[0], req[1], req[2] + 1
            finish = finish_length(wanted) if req[2] == wanted else None
            out = ReqOutput(rid, [42], finish, prompt_tokens, req[2], 0, DecodeOptions())
            outputs.append(ReqStrOutput(out, self.token_text))
            if finish is not None:
                del self.running[rid]
        self.outbox.send_pyobj(BatchStrOut(outputs))


def run_stand_in(port_args: Any, step_s: float, token_text: str) -> None:
    StandInScheduler(port_args, step_s, token_text).serve()


def run_front(port_args: Any, model_path: str, port: int, context_len: int) -> None:
    """The front process as `launch_server` runs it, over the stand-in's sockets."""
    import uvicorn

    from managers.io_struct import SchedulerReady
    from managers.tokenizer_manager import TokenizerManager
    from srt.entrypoints.http_server import create_app
    from srt.server_args import ServerArgs

    # Prompts come as ids and the stand-in sends the text: no tokenizer to load.
    args = ServerArgs(model_path=model_path, port=port, device="cpu", skip_tokenizer_init=True)
    ready = SchedulerReady(model_path, context_len, 49152, 1 << 22, 4096, [], "cpu")
    tm = TokenizerManager(args, port_args, ready, "stand-in")
    config = uvicorn.Config(create_app(tm, args), port=port, log_level="warning")
    uvicorn.Server(config).run()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_stream_args(p, port=31556, num_prompts=256)
    p.add_argument("--step-ms", type=float, default=10.0, help="the stand-in's decode step")
    p.add_argument("--token-text", default=" word", help="the text of every token")
    args = p.parse_args(argv)

    from srt.model_loader.sources import resolve_model_path
    from srt.utils.process import PortArgs

    args.model_path = resolve_model_path(args.model_path)
    port_args = PortArgs.new()
    ctx = mp.get_context("spawn")
    stand_in = ctx.Process(
        target=run_stand_in, args=(port_args, args.step_ms / 1e3, args.token_text), daemon=True
    )
    context_len = args.input_len + args.output_len + 64
    front = ctx.Process(
        target=run_front, args=(port_args, args.model_path, args.port, context_len), daemon=True
    )
    stand_in.start()
    front.start()
    try:
        wait_until_healthy(args.port, front.is_alive, STARTUP_TIMEOUT_S)
        before = cpu_seconds(front.pid)
        extra = ("--random-range-ratio", "1.0", "--warmup-requests", "0")
        report = stream_random(args, *extra, dataset="random-ids")
        front_cpu = cpu_seconds(front.pid) - before  # ~0 while the client starts
    finally:
        for proc in (front, stand_in):
            proc.terminate()
            proc.join(5)
        port_args.cleanup()
    tokens = int(reported(report, "Total generated tokens"))
    duration = reported(report, "Benchmark duration (s)")
    if tokens != args.num_prompts * args.output_len:
        raise SystemExit(f"{tokens} tokens arrived, not {args.num_prompts * args.output_len}")
    offered = args.num_prompts * 1e3 / args.step_ms
    print(f"{args.num_prompts} streams x {args.output_len} tokens, a step every {args.step_ms} ms")
    print(f"offered  {offered:9.0f} tok/s (all streams running)")
    print(f"received {reported(report, 'Output token throughput (tok/s)'):9.0f} tok/s")
    for name, cpu in (("front", front_cpu), ("client", reported(report, "Client CPU seconds"))):
        print(
            f"{name:7s}  {cpu / duration:5.2f} CPU s/s  {cpu / tokens * 1e6:6.1f} µs/token"
            f"  ({cpu:.2f} s in {duration:.2f} s)"
        )


if __name__ == "__main__":
    main()
