"""``python -m dsv41.serve``: the OpenAI-compatible HTTP server over one engine.

The model flags are ``python -m dsv41.run``'s (``run.add_model_arguments``, with the same rows of
``dsv41.cli.args``); TINY random weights by default, ``--checkpoint DIR`` for a folder (and its
tokenizer: without one the server takes and returns token ids). Every argument is checked, and
the listening socket bound, before the engine is built, the chat format among them: a tokenizer
missing a control token the format needs is refused at start-up, naming the file and the token; a
port in use or a host that is not this machine's is one line and exit status 2. SIGINT ends it
with status 130 (as a run), SIGTERM with 143; either lets the requests in flight run for
``--shutdown-timeout`` seconds, then ends each still running with finish reason "abort" (a
stream gets its final event and ``[DONE]``); a second signal ends the wait at once.
"""
from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys
import threading

from dsv41.checkpoint.errors import CheckpointError
from dsv41.checkpoint.text import CHAT_FORMATS
from dsv41.cli import args as rules
from dsv41.cli import interrupt, run, speculative
from dsv41.cli.modes import DIST, RUN, groups, topology
from dsv41.cli.progress import Progress
from dsv41.cluster.connect import ConnectError
from dsv41.serving.structured import COMPILE_BUDGET_S

PROG = "python -m dsv41.serve"
DEFAULT_CONTEXT = 512
MIN_BODY_BYTES = 1024
# what waiting requests may hold: each queued request keeps its body (up to --max-body-bytes) and prompt
MAX_QUEUE = 65536
MAX_BODY_BYTES = 1 << 30
DRAIN_S = 10.0        # how long a stopping server lets the requests in flight run, by default
BACKLOG = 2048        # uvicorn's default listen backlog
SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}   # as a shell reports a process the signal ended

SERVE_APPLIES = {**{f: rules.APPLIES[f] for f in run.MODEL_FLAGS}, **speculative.APPLIES,
                 **dict.fromkeys(("--host", "--port", "--max-batch", "--max-context", "--max-queue",
                                  "--max-body-bytes", "--served-model-name", "--read-timeout",
                                  "--shutdown-timeout", "--metrics-names", "--max-num-batched-tokens",
                                  "--max-total-tokens", "--enable-prefix-caching", "--no-enable-prefix-caching",
                                  "--require-cache-salt", "--grammar-compile-timeout"),
                                 (RUN, None)),
                 "--chat-format": (RUN, ("needs --checkpoint (chats need its tokenizer)", lambda a: a.checkpoint)),
                 "--dashboard": (DIST, None)}     # the server runs until stopped: no --hold


def build_parser() -> rules.Parser:
    p = rules.Parser(prog=PROG, description=__doc__.splitlines()[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_model_arguments(p)
    g = p.add_argument_group("serving")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--max-batch", type=int, default=None,
                   help="requests decoded together (default: the model's capacity per DP group x DP groups)")
    g.add_argument("--max-context", type=int, default=None,
                   help=f"tokens one request reaches, prompt and answer (default: {DEFAULT_CONTEXT} or the "
                        "model's limit)")
    run.add_budget_arguments(g)
    run.add_prefix_caching_argument(g, True)
    g.add_argument("--require-cache-salt", action="store_true",
                   help="refuse a request without vLLM's cache_salt (400): for a server several tenants share, "
                        "each sending its own salt, so that no tenant's prompt shares cached spans with "
                        "another's (whose cached_tokens would tell it what the other sent)")
    g.add_argument("--grammar-compile-timeout", type=float, default=COMPILE_BUDGET_S,
                   help="seconds a structured output's new constraint may take to compile (in a process of its "
                        "own, killed then: the request is a 400) (default: %(default)s)")
    g.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for a batch slot; one more is answered 429 (default: %(default)s)")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    g.add_argument("--chat-format", default=None, choices=CHAT_FORMATS,
                   help="how chats are rendered (default: the checkpoint's chat_template if it has one, else "
                        "v4.1 when its tokenizer has V4.1's <｜System｜> token, else v4)")
    g.add_argument("--dashboard", action="store_true",
                   help="distributed: print the dask dashboard's link once the cluster is up")
    g.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a client has to send a request's headers, and again its body; a stalled "
                        "connection is closed, a stalled body answered 408 (default: %(default)s)")
    g.add_argument("--shutdown-timeout", type=float, default=DRAIN_S,
                   help="seconds a stopping server (SIGTERM, SIGINT) lets the requests in flight run; then "
                        "each still running ends with finish_reason \"abort\" and a stream with its final "
                        "event and [DONE]; a second signal ends the wait at once (default: %(default)s)")
    g.add_argument("--metrics-names", default="dsv41", choices=("dsv41", "vllm", "both"),
                   help="/metrics series names: dsv41's, vLLM's (vllm:..., with its model_name and engine "
                        "labels and its buckets) so that a dashboard made for vLLM works unchanged, or both "
                        "at once (one server feeding both dashboards) (default: %(default)s)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name requests must name (default: the config's name, or the checkpoint "
                        "folder's)")
    speculative.add_arguments(p.add_argument_group("speculative decoding"))
    # what the shared checks read from a run that a server does not have
    p.set_defaults(plan=False, graph="decode", context=None, prompt=None, prompt_file=None, chat=False,
                   allow_special_tokens=False, hold=None, show_graph=None, check=False, trace=None,
                   report=False, new_tokens=0)
    return p


def _port(a, cfg):
    if not 0 <= a.port <= 65535:
        return f"must be in [0, 65535], got {a.port}"


def _max_batch(a, cfg):
    per = a.capacity.max_batch_per_dp
    if not 1 <= a.max_batch <= per * groups(a):
        return f"must be in [1, {per * groups(a)}] ({per} per DP group {rules.on(a, cfg)}), got {a.max_batch}"


def _max_context(a, cfg):
    top = cfg.max_position_embeddings
    if not 2 <= a.max_context <= top:
        return f"must be in [2, {top}] tokens {rules.on(a, cfg)}, got {a.max_context}"


def _max_queue(a, cfg):
    if not 0 <= a.max_queue <= MAX_QUEUE:
        return f"must be in [0, {MAX_QUEUE}], got {a.max_queue}"


def _max_body_bytes(a, cfg):
    if not MIN_BODY_BYTES <= a.max_body_bytes <= MAX_BODY_BYTES:
        return f"must be in [{MIN_BODY_BYTES}, {MAX_BODY_BYTES}], got {a.max_body_bytes}"


def _read_timeout(a, cfg):
    if not 0 < a.read_timeout <= 3600:
        return f"must be in (0, 3600] seconds, got {a.read_timeout}"


def _grammar_compile_timeout(a, cfg):
    if not 0 < a.grammar_compile_timeout <= 3600:
        return f"must be in (0, 3600] seconds, got {a.grammar_compile_timeout}"


def _shutdown_timeout(a, cfg):
    if not 0 <= a.shutdown_timeout <= 3600:
        return f"must be in [0, 3600] seconds, got {a.shutdown_timeout}"


def _sizes(a, cfg):
    """The capacity defaults, and the run fields the budget check sizes (a batch of max-context requests)."""
    if a.max_batch is None:
        a.max_batch = a.capacity.max_batch_per_dp * groups(a)
    if a.max_context is None:
        a.max_context = min(DEFAULT_CONTEXT, cfg.max_position_embeddings)
    a.batch, a.prompt_len = a.max_batch, a.max_context - 1


CHECKS = [(f, c) for f, c in rules.CHECKS if f in SERVE_APPLIES and f != "--dashboard"] + [
    ("--port", _port), ("--max-batch", _max_batch), ("--max-context", _max_context), ("--max-queue", _max_queue),
    ("--max-body-bytes", _max_body_bytes), ("--read-timeout", _read_timeout),
    ("--shutdown-timeout", _shutdown_timeout), ("--grammar-compile-timeout", _grammar_compile_timeout)
] + speculative.CHECKS + rules.LAST


def parse_args(argv=None, parser: rules.Parser | None = None):
    return rules.parse_checked(parser or build_parser(), argv, SERVE_APPLIES, _check_values)


def _check_values(a) -> None:
    rules.run_checks(a, None, [c for c in rules.FIRST if c[0] in SERVE_APPLIES], SERVE_APPLIES)
    cfg = rules.model_config(a)
    _sizes(a, cfg)
    rules.run_checks(a, cfg, CHECKS, SERVE_APPLIES)
    if a.codec is not None:
        problem = a.codec.use_chat_format(a.chat_format)
        if problem:
            raise rules.UsageError(f"{'--chat-format' if a.chat_format else '--checkpoint'}: {problem}")


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now so that a bad address is refused before any work."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise rules.UsageError(f"--host: cannot resolve {host!r} ({getattr(e, 'strerror', None) or e})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # a listener's old TIME_WAIT pairs
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise rules.UsageError(f"--port: {port} is in use on {host} (pick another, or 0 for any free one)"
                                   ) from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise rules.UsageError(f"--host: {host} is not an address of this machine") from None
        raise rules.UsageError(f"--host/--port: cannot listen on {host}:{port} ({e.strerror})") from None
    return sock


class Signals:
    """How the command meets SIGINT and SIGTERM, from its first line to its last. While it starts
    (arguments, tokenizer, engine) a signal interrupts it (``KeyboardInterrupt``, interrupt's
    ``Terminated`` for SIGTERM) and is remembered, so that whatever the interruption broke on its
    way out (an import cut in half fails later with another error) still ends in one line and the
    signal's status. Once the server is built, a signal only asks it to stop (``serving``: uvicorn's
    drain); after the server has stopped, one more ends the clean-up at once."""

    def __init__(self):
        self.received: int | None = None
        self.main = threading.current_thread() is threading.main_thread()   # where signals are handled
        self._set(self._interrupt)

    def _set(self, handler):
        if self.main:
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, handler)

    def _interrupt(self, signum, frame):
        self.received = self.received or signum
        raise interrupt.Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()

    def serving(self, server) -> None:
        self._set(server.handle_exit)

    def cleaning_up(self, status: int) -> None:
        self._set(lambda signum, frame: self.leave(status))

    @staticmethod
    def leave(status: int) -> None:
        print(f"{PROG}: {'terminated' if status == 143 else 'interrupted'}", file=sys.stderr)
        interrupt.exit_now(status)

    def restore(self) -> None:
        self._set(signal.default_int_handler)
        if self.main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def main(argv=None) -> int:
    signals = Signals()
    try:
        parser = build_parser()
        args = parse_args(argv, parser)
        try:
            args.socket = listen(args.host, args.port)
        except rules.UsageError as e:
            if args.debug:
                raise
            parser.error(str(e))
        try:
            status = serve(args, signals)
        except (ConnectError, CheckpointError) as e:
            if args.debug:
                raise
            # a checkpoint found bad past the up-front checks reads as run's does (cli.run._refuse)
            parser.error(f"--checkpoint: {e}" if isinstance(e, CheckpointError) else str(e))
    except (KeyboardInterrupt, Exception):
        if signals.received is None or "--debug" in (sys.argv[1:] if argv is None else argv):
            raise
        status = SIGNAL_EXIT[signals.received]
        print(f"{PROG}: {'terminated' if status == 143 else 'interrupted'}", file=sys.stderr)
    finally:
        signals.restore()
    if status == 143 and signals.main and argv is None:
        signal.raise_signal(signal.SIGTERM)       # ended as the signal ends a process (its handler is back)
    return status


def _drafting(args) -> str:
    """The start line's word on speculative decoding (nothing when it is off)."""
    if args.speculative is None:
        return ""
    if args.speculative == "ngram":
        k = speculative.DEFAULT_DRAFTS if args.draft_tokens is None else args.draft_tokens
        return f", speculative decoding: ngram ({k} draft tokens, suffixes of {args.ngram_min}-{args.ngram_max})"
    k = "the checkpoint's block" if args.draft_tokens is None else f"{args.draft_tokens} draft tokens"
    threshold = "" if args.confidence_threshold is None else f", confidence threshold {args.confidence_threshold:g}"
    return f", speculative decoding: dspark ({k}{threshold})"


def serve(args, signals: Signals) -> int:
    import uvicorn

    from dsv41.serving.app import Server
    from dsv41.serving.protocol import QuietDrainEnd, StoppableServer, timed_h11
    from dsv41.serving.batcher import Batcher
    from dsv41.serving.metrics import Metrics
    from dsv41.serving.schema import Limits

    ckpt = None
    if args.checkpoint is not None:
        from dsv41.checkpoint.reader import open_checkpoint
        try:
            ckpt = open_checkpoint(args.checkpoint, args.verify_checksums)
        except OSError as e:        # a file of the folder that cannot be read (permissions)
            raise CheckpointError(rules.unreadable(e)) from e
        rules.warn_unverified(PROG, args, ckpt)
        if args.speculative == "dspark":
            ckpt.require_dspark()            # a CheckpointError: one line, exit 2
    cfg = rules.resolve_model(args, ckpt)
    progress = Progress(json_mode=True)       # every line to stderr
    try:
        engine = run.make_engine(args, cfg, topology(args), progress, ckpt)
    except OSError as e:
        if ckpt is None:
            raise
        raise CheckpointError(rules.unreadable(e)) from e
    name = args.served_model_name or (cfg.name if ckpt is None else os.path.basename(os.path.abspath(args.checkpoint)))
    # a prompt of any length up to the context is fed in chunks: max_model_len is what is enforced
    limits = Limits(max_context=args.max_context, max_prompt=args.max_context - 1,
                    vocab_size=cfg.vocab_size, max_body_bytes=args.max_body_bytes,
                    require_cache_salt=args.require_cache_salt)
    drafter = speculative.drafter(args, engine)
    cache = {"block_size": str(cfg.block_size), "num_gpu_blocks": str(engine.blocks_in_use()[1]),
             "enable_prefix_caching": str(engine.prefix_caching)}
    metrics = Metrics(args.metrics_names, name, args.max_context, cache, 0 if drafter is None else drafter.k)
    batcher = Batcher(engine, metrics, args.max_batch, args.max_queue, args.max_num_batched_tokens, drafter)
    batcher.start()
    try:
        server = Server(batcher, args.codec, name, limits, metrics, args.read_timeout, args.grammar_compile_timeout)
        host, port = args.socket.getsockname()[:2]
        answers = "token ids only (no --checkpoint)" if args.codec is None else \
            f"text, chat format {args.codec.chat_format}"
        progress.say(f"dsv41 serve: model {name!r} ({cfg.name}, executor {args.executor}), {answers}, "
                     f"max_batch={args.max_batch} max_context={args.max_context}{_drafting(args)}; "
                     f"listening on http://{host}:{port}")
        logging.getLogger("uvicorn.error").addFilter(QuietDrainEnd())
        config = uvicorn.Config(server.app(), log_level="warning", http=timed_h11(args.read_timeout),
                                timeout_graceful_shutdown=args.shutdown_timeout)
        stoppable = StoppableServer(config, on_drain_start=server.drain, on_drain_end=server.abort_all)
        signals.serving(stoppable)
        stoppable.run(sockets=[args.socket])
        status = SIGNAL_EXIT.get(stoppable.stopped_by, 0)
        signals.cleaning_up(status)
    finally:
        args.socket.close()
        batcher.stop()
        engine.close()
    return status
