"""`harness-rl serve engine`: the embedded transformers engine behind vLLM's HTTP API."""

import argparse
from pathlib import Path


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "engine",
        help="serve a local transformers model (or the offline tiny model) with vLLM's token API",
        description="Serve a local model with vLLM's chat, completions, tokenizer and weight-update routes, so the "
                    "proxy and the learner cannot tell it from vLLM. Every response carries x-policy-version.",
    )
    parser.add_argument("--model", default="tiny",
                        help="'tiny' (built offline) or a local model directory (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=65536,
                        help="context length, capped by the model's own (default: %(default)s)")
    parser.add_argument("--served-model-name", default=None,
                        help="model name in answers and /v1/models (default: 'tiny', or the directory's name)")
    parser.add_argument("--logprobs-mode", choices=("processed_logprobs", "raw_logprobs"), default="processed_logprobs",
                        help="logprobs after temperature and top-k/top-p (processed) or of the raw logits "
                             "(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="tiny model seed and sampling seed (default: %(default)s)")
    parser.add_argument("--enable-forced-completions", action="store_true",
                        help="TESTS ONLY: mount /forced_completions, which scripts the engine's answers (default: off)")
    parser.add_argument("--return-tokens-as-token-ids", action=argparse.BooleanOptionalAction, default=True,
                        help="logprob tokens as 'token_id:N' unless a request says otherwise, as exact capture "
                             "needs (default: on)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where the tiny model is built (default: ~/.cache/harness-rl/tiny-SEED, or "
                             "$HARNESS_RL_CACHE)")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch intra-op threads (default: 1 under 50M parameters, else torch's)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import os
    import sys

    from harness_rl.engine import Engine, create_app
    from harness_rl.engine.serving import serve_forever

    try:
        engine = Engine.from_pretrained(
            args.model,
            cache_dir=args.cache_dir,
            seed=args.seed,
            served_model_name=args.served_model_name,
            max_model_len=args.max_model_len,
            logprobs_mode=args.logprobs_mode,
            num_threads=args.num_threads,
        )
    except (FileNotFoundError, OSError, ValueError) as error:
        print(f"harness-rl serve engine: --model {args.model}: {error}", file=sys.stderr)
        return 2
    app = create_app(
        engine,
        forced_completions=args.enable_forced_completions,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
    )
    try:
        serve_forever(app, args.host, args.port)
    except OSError as error:
        print(f"harness-rl serve engine: cannot listen on {args.host}:{args.port}: {error.strerror}", file=sys.stderr)
        return 1
    finally:
        engine.close(timeout=1.0)  # generations were aborted; never hold the exit behind a long forward pass
    # Stopped by a signal with nothing left to write: skip the interpreter's teardown of torch and
    # transformers, which takes seconds on a busy machine, so SIGTERM ends the engine promptly.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
