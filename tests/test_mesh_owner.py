"""One owner of meshes and process groups (``parallel/mesh.py``): nothing else in shardwise builds
one, checked twice -- in the source (every call of a mesh or group constructor) and at run time (a
256-rank Session on torch's ``fake`` backend with every constructor patched to name its caller)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "shardwise"
OWNER = SRC / "parallel" / "mesh.py"
# What makes a mesh or a process group in torch 2.13.
CONSTRUCTORS = {"init_device_mesh", "new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group",
                "_unflatten", "_flatten", "DeviceMesh", "from_group"}
# A plain-torch script kept independent of shardwise on purpose: the reference FSDP2 run that bench
# compares shardwise against (it must not share shardwise's code to be a reference).
EXEMPT = {SRC / "reference" / "torch_fsdp2.py"}


def _constructor_calls(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in CONSTRUCTORS:
                found.append(f"{path.relative_to(SRC)}:{node.lineno} {name}()")
    return found


def test_no_mesh_or_group_is_built_outside_the_owner() -> None:
    outside = [call for path in sorted(SRC.rglob("*.py")) if path != OWNER and path not in EXEMPT
               for call in _constructor_calls(path)]
    assert not outside, "build meshes and groups in parallel/mesh.py (ask ctx.meshes):\n" + "\n".join(outside)
    assert _constructor_calls(OWNER), "the owner itself builds them"


_FAKE_RUN = r"""
import json, sys
import torch, torch.distributed as dist
import torch.distributed.device_mesh as dm
import torch.distributed.distributed_c10d as c10d
from torch.testing._internal.distributed.fake_pg import FakeStore

SRC, OWNER = sys.argv[1], sys.argv[2]
callers = []

def spy(fn):
    def wrapped(*args, **kwargs):
        # The first shardwise frame on the stack asked for it (torch's own frames are skipped); walked
        # by hand: inspect.stack() reads every frame's source lines, seconds per call here.
        frame = sys._getframe(1)
        while frame is not None and not frame.f_code.co_filename.startswith(SRC):
            frame = frame.f_back
        callers.append(frame.f_code.co_filename if frame else "<not shardwise>")
        return fn(*args, **kwargs)
    return wrapped

for mod in (dist, c10d, dm):
    for name in ("new_group", "split_group", "init_device_mesh"):
        if hasattr(mod, name):
            setattr(mod, name, spy(getattr(mod, name)))

# How a caller rehearses rank r of N: start the process group first; the Session reads rank and world.
dist.init_process_group("fake", store=FakeStore(), rank=37, world_size=256)
from shardwise.core.config import ParallelConfig
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.runtime.session import Session

session = Session(parallel=ParallelConfig(strategy="fsdp+tp+pp", tp=2, pp=2, cp=2, ep=2), loss_chunks=0)
cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32, dropout=0.0, bias=False,
                n_experts=4)
model = session.build(lambda: GPT(cfg))
session.prepare(model, lambda params: torch.optim.AdamW(params))
m = session.meshes
print(json.dumps({"rank": session.rank, "world": session.world_size, "callers": callers,
                  "dense": list(m.dense.mesh_dim_names), "dense_shape": list(m.dense.shape),
                  "cp": m.batch["cp"].size(), "cp_rank": m.batch["cp"].get_local_rank(),
                  "layout_cp_rank": session.cp_rank, "ep": m.ep.size(), "efsdp": m.expert_fsdp.size(),
                  "dp_coords": list(session.layout.dp_coords(session.rank))}))
"""


def test_fake_backend_session_asks_the_owner_for_every_group(tmp_path: Path) -> None:
    """A 256-rank fsdp+tp+pp x cp x ep Session on the fake backend builds and prepares, and every
    mesh and group is made by the owner."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-c", _FAKE_RUN, str(SRC), str(OWNER)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["rank"], out["world"]) == (37, 256)
    assert out["callers"] and set(out["callers"]) == {str(OWNER)}, out["callers"]
    # pp=2 x dp=64 (dp_shard=32 x cp=2) x tp=2; ep borrowed from dp_shard x cp.
    assert out["dense"] == ["pp", "dp", "tp"] and out["dense_shape"] == [2, 64, 2]
    assert out["cp"] == 2 and out["cp_rank"] == out["layout_cp_rank"]
    assert out["ep"] == 2 and out["efsdp"] == 32
