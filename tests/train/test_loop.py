"""Stage-1 loop: exact resume, divergence handling, only routers change, data order."""

import pytest
import torch

from wide_cli.errors import CheckpointError, TrainingDivergedError
from wide_cli.models.tiny import tiny_model
from wide_cli.routing import RoutingConfig, attach_routers
from wide_cli.routing.model import router_state_dict
from wide_cli.train.config import TrainConfig
from wide_cli.train.data_order import batch_indices
from wide_cli.train.loop import train_stage

DATA = torch.randint(0, 128, (24, 16), generator=torch.Generator().manual_seed(0))
CFG = TrainConfig(steps=12, batch_size=2, grad_accum=2, seq_len=16, checkpoint_every=4, lr=1e-2)


def _model(seed=0):
    m = tiny_model("llama")
    for p in m.parameters():
        p.requires_grad_(False)
    torch.manual_seed(seed)
    attach_routers(m, RoutingConfig(attn_group_size=2, ffn_group_size=32, sparsity=0.5))
    return m


def _run(stage_dir, *, stop_at=None, resume=False, cfg=CFG, identity=None):
    m = _model()

    def cb(step, metrics):
        if stop_at is not None and step == stop_at:
            raise KeyboardInterrupt

    res = train_stage(m, DATA, cfg, stage_dir=stage_dir, identity=identity or {"k": 1}, resume=resume,
                      progress=False, on_step=cb)
    return m, res


@pytest.mark.parametrize("stop_at", [3, 4, 6])
def test_resume_after_interrupt_matches_uninterrupted(tmp_path, stop_at):
    full, res = _run(tmp_path / "a")
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path / "b", stop_at=stop_at)
    resumed, res2 = _run(tmp_path / "b", resume=True)
    assert res2.resumed_from == stop_at
    a, b = router_state_dict(full), router_state_dict(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert res.tokens == res2.tokens == 12 * 4 * 16


def test_only_router_parameters_change(tmp_path):
    before = {k: v.clone() for k, v in _model().state_dict().items()}
    m, _ = _run(tmp_path)
    after = m.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".router_" in k for k in changed)


def test_non_finite_loss_names_step_and_keeps_checkpoint(tmp_path):
    m = _model()
    calls = {"n": 0}
    orig = m.forward

    def poisoned(*a, **k):
        out = orig(*a, **k)
        calls["n"] += 1
        if calls["n"] > 10:  # from step 6 on (2 micro-batches per step)
            out.loss = out.loss * float("nan")
        return out

    m.forward = poisoned
    with pytest.raises(TrainingDivergedError, match=r"non-finite loss \(nan\) at step 6; last good checkpoint is step 4"):
        train_stage(m, DATA, CFG, stage_dir=tmp_path, identity={"k": 1}, progress=False)
    assert (tmp_path / "checkpoint" / "state.json").is_file()


def test_resume_with_other_identity_is_refused(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, stop_at=4, identity={"model": "a"})
    with pytest.raises(CheckpointError, match="made with different model"):
        _run(tmp_path, resume=True, identity={"model": "b"})


def test_sparsity_moves_toward_target(tmp_path):
    cfg = TrainConfig(steps=30, batch_size=4, seq_len=16, lr=2e-2, checkpoint_every=0)
    m = _model()
    res = train_stage(m, DATA, cfg, stage_dir=tmp_path, identity={}, progress=False)
    assert abs(res.final["sparsity"] - 0.5) < 0.1


def test_batch_indices_cover_each_epoch_and_shard_by_rank():
    n, b = 10, 3
    stream = torch.cat([batch_indices(n, b, j, seed=1) for j in range(10)])
    assert sorted(stream[:10].tolist()) == list(range(10))  # first epoch is a permutation
    two = torch.cat([batch_indices(n, b, 0, 1, rank=0, world=2), batch_indices(n, b, 0, 1, rank=1, world=2)])
    assert torch.equal(two, batch_indices(n, 2 * b, 0, 1))
