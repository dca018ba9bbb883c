"""One rank of a sharded learner (FSDP2 over gloo, under torchrun) read by vLLM's own `nccl_m2n` source and
layout check, as vLLM's M2N trainer engine reads a learner before any rendezvous: the mesh, each parameter's
placement, the parameters whose layout M2N refuses, and whether M2N's runtime imports here.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/m2n_layout_worker.py MODEL_DIR OUT VLLM_PY
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness_rl.learner.config import LearnerConfig
from harness_rl.learner.distributed import leave
from harness_rl.learner.learner import Learner
from harness_rl.learner.vllm_transfer import import_vllm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("vllm_python")
    args = parser.parse_args()
    import_vllm(args.vllm_python)
    from vllm.distributed.weight_transfer.m2n_common import import_m2n, resolve_layout, validate_layout
    from vllm.distributed.weight_transfer.m2n_source import DTensorModuleSource

    learner = Learner(args.model_dir, LearnerConfig(learning_rate=1e-3, max_steps=1))
    try:
        source = DTensorModuleSource(learner.model, learner.ranks.world_size)
        mesh = source.mesh()
        placements, refused = {}, {}
        for meta in source.metadata():
            placements[meta.name] = meta.placements
            try:
                validate_layout(*resolve_layout(mesh, meta.placements), meta.shape, "source")
            except ValueError as refusal:
                refused[meta.name] = str(refusal)
        try:
            import_m2n()
            runtime = ""
        except ImportError as missing:
            runtime = str(missing)
        local = {name: list(tensor.shape) for name, tensor in source}  # each rank's own shard, nothing gathered
        report = {"mesh": list(mesh.dims), "placements": placements, "refused": refused, "runtime": runtime,
                  "local_shapes": local}
        (args.out / f"rank{learner.ranks.rank}.json").write_text(json.dumps(report))
    finally:
        del learner
        leave()


if __name__ == "__main__":
    main()
