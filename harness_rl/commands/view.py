"""`harness-rl view RUN_DIR | TRACE... [-o page.html] [--serve]`: see what was trained, in a browser."""

from __future__ import annotations

import argparse
import http.server
import sys
from pathlib import Path
from typing import NoReturn

from harness_rl.viewer.load import DEFAULT_MAX_BYTES


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "view", help="write a self-contained HTML page of a run or of trace files (optionally serve it)",
        description="Charts of a run's metrics, every step's groups with rewards and advantages, and each rollout's "
                    "turn graph, messages and completion tokens coloured by loss mask and behaviour logprob. "
                    "The page is one file with no outside references: it opens offline.")
    parser.add_argument("paths", nargs="+", type=Path, metavar="RUN_DIR | TRACE",
                        help="a run directory (harness-rl train --output-dir), or one or more trace files")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="the HTML file to write (default: RUN_DIR/view.html, or ./view.html for trace files)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a tokenizer.json (or a directory holding one) for token text; default: the run's newest "
                             "checkpoint's, else the configured model's if it is on disk; none found shows token ids")
    parser.add_argument("--steps", type=_step_range, default=(None, None), metavar="FIRST:LAST",
                        help="embed traces only for rollouts of these steps (inclusive; either side may be empty), "
                             "to keep the page small for long runs; metrics and rewards cover every step")
    parser.add_argument("--max-mb", type=float, default=DEFAULT_MAX_BYTES / 1e6,
                        help="at most this many megabytes of traces in the page, newest steps first "
                             "(default %(default)g)")
    parser.add_argument("--serve", action="store_true",
                        help="also serve the page on http://127.0.0.1:PORT/ until Ctrl-C")
    parser.add_argument("--port", type=int, default=8765, help="port for --serve (default 8765; 0 picks a free one)")
    parser.set_defaults(run=run)


def _step_range(text: str) -> tuple[int | None, int | None]:
    first, sep, last = text.partition(":")
    try:
        if not sep:
            return int(first), int(first)
        return (int(first) if first else None), (int(last) if last else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not FIRST:LAST (e.g. 30:40, 30: or :10)") from None


def refuse(message: str) -> NoReturn:
    """Bad input: one line, exit 2, nothing written."""
    print(f"harness-rl view: {message}", file=sys.stderr)
    raise SystemExit(2)


def run(args: argparse.Namespace) -> int:
    from harness_rl.viewer.load import NoTraceError, load_run, load_traces
    from harness_rl.viewer.page import render_page
    from harness_rl.viewer.tokens import TokenizerError, find_tokenizer, open_tokenizer

    paths: list[Path] = args.paths
    missing = [p for p in paths if not p.exists()]
    if missing:
        refuse(f"{missing[0]}: no such file or directory")
    run_dir = paths[0] if len(paths) == 1 and paths[0].is_dir() else None
    if run_dir is None and any(p.is_dir() for p in paths):
        refuse("give one run directory, or trace files (not both)")
    tokenizer_path = args.tokenizer or (find_tokenizer(run_dir) if run_dir else None)
    try:
        tokens = open_tokenizer(tokenizer_path) if tokenizer_path else None
        view = load_run(run_dir, tokens, args.steps, int(args.max_mb * 1e6)) if run_dir else load_traces(paths, tokens)
    except (TokenizerError, NoTraceError) as exc:
        refuse(str(exc))
    output = args.output or (run_dir / "view.html" if run_dir else Path("view.html"))
    page = render_page(view).encode("utf-8")
    output.write_bytes(page)
    traced = sum(1 for r in view.rollouts if r.turns is not None)
    print(f"wrote {output} ({len(page) / 1e6:.2f} MB: {len(view.metrics)} steps, {len(view.rollouts)} rollouts, "
          f"{traced} with traces; {'token text from ' + str(tokens.path) if tokens else 'no tokenizer: token ids'})")
    if args.serve:
        serve(page, args.port)
    return 0


def serve(page: bytes, port: int) -> None:
    """Serve `page` at / on loopback until interrupted."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            if self.path.split("?")[0] not in ("/", "/index.html"):
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, format: str, *args: object) -> None:
            pass

    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    except OSError as exc:
        raise SystemExit(f"harness-rl view: cannot serve on 127.0.0.1:{port}: {exc.strerror}; try --port 0") from None
    print(f"serving on http://127.0.0.1:{server.server_address[1]}/ (Ctrl-C to stop)", file=sys.stderr, flush=True)
    with server:
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
