"""Checkpoints written by megatron-core itself (CPU, gloo; see megatron_real) -> HF, in both formats (also a MoE model
saved with expert parallelism: per-rank files per EP rank; torch_dist with its experts as [layers, experts, ...]
global tensors).

Chain: tiny HF model -> rl-ckpt's rank files -> megatron-core GPTModel (loaded strictly, forward pass) -> saved by
megatron as Megatron-LM saves (per-rank legacy files and torch_dist) -> rl-ckpt -> HF. The HF tensors must equal the
source model's bit for bit (megatron only copied them), and the converted model's logits must equal the Megatron
model's. Tolerance 1e-5 on logits of magnitude ~1 in fp32: megatron and transformers sum in different orders (fused
QKV / gate-up matmuls, TP all-gathers, RoPE), measured <= 5e-7; a misplaced head, group or vocabulary row moves
logits by > 1e-2.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import weakref

import pytest
import torch
import transformers
from ckpt_models import VOCAB, load_state
from megatron_real import INPUT_IDS, ITERATION, Case, make_real_checkpoints

from rl_ckpt import CheckpointError, convert_mcore_to_hf, open_mcore_checkpoint
from rl_ckpt.cli import main
from rl_ckpt.dcp_reader import DcpFolder

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
        reason="megatron-core is not installed",
    ),
    pytest.mark.slow,
]
LOGITS_ATOL = 1e-5
CASES = ["tp2", "pp2", "tp1", "ep2", "tp2_moe", "vpp2"]
FORMATS = ["legacy", "dist"]


@pytest.fixture(scope="module")
def real(tiny_hf, tmp_path_factory):
    """Folder with one sub-folder per case: TP=2 (Qwen2, untied), PP=2 (Qwen2, tied), TP=1 (Qwen3, tied), EP=2
    (Qwen3-MoE, 4 experts: two per rank), TP=2 on the same MoE model (every expert split over the two ranks:
    Megatron's expert tensor parallelism at its default size), PP=2 with a virtual pipeline of 2 chunks per stage
    (Qwen2, tied: the output layer's copy in the last stage's last chunk; Megatron-LM's legacy files only, model0 /
    model1)."""
    from rl_engines.tiny_model import build_tiny_moe_lm

    out = tmp_path_factory.mktemp("megatron_real")
    moe = out / "hf_qwen3_moe"
    build_tiny_moe_lm(moe, vocab_size=VOCAB, num_key_value_heads=2)  # TP = 2 splits the KV heads
    cases = [
        Case("tp2", tiny_hf("qwen2", False), tp=2, pp=1),
        Case("pp2", tiny_hf("qwen2", True), tp=1, pp=2),
        Case("tp1", tiny_hf("qwen3", True), tp=1, pp=1, hf_dir_in_args=False),
        Case("ep2", moe, tp=1, pp=1, ep=2, grouped=True),
        Case("tp2_moe", moe, tp=2, pp=1, grouped=True),
        Case("vpp2", tiny_hf("qwen2", True), tp=1, pp=2, vp=2, formats=("torch",)),
    ]
    make_real_checkpoints(cases, out)
    return {case.name: case for case in cases}, out


def hf_logits(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(INPUT_IDS)).logits


def iter_dir(real, name, fmt):
    return real[1] / name / fmt / f"iter_{ITERATION:07d}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", CASES)
def test_ckpt_real_megatron_to_hf_is_bitwise_and_logits_match(real, tmp_path, name, fmt):
    cases, out = real
    case = cases[name]
    if fmt == "dist" and "torch_dist" not in case.formats:
        pytest.skip(f"{name} is saved in Megatron-LM's legacy format only")
    megatron = torch.load(out / name / "megatron_logits.pt")
    source = hf_logits(case.hf_dir)
    torch.testing.assert_close(megatron, source, atol=LOGITS_ATOL, rtol=0)  # megatron-core ran the loaded model

    # tp2 / pp2: no flags, the args' tokenizer_model folder gives config.json; tp1: args alone, as on another machine
    ckpt = open_mcore_checkpoint(out / name / fmt, vocab_size=VOCAB if name == "tp1" else None)
    assert ckpt.spec.model_type == {"tp1": "qwen3", "ep2": "qwen3_moe", "tp2_moe": "qwen3_moe"}.get(name, "qwen2")
    convert_mcore_to_hf(ckpt, tmp_path / "hf", max_shard_size="50KB")
    before, after = load_state(case.hf_dir), load_state(tmp_path / "hf")
    assert sorted(after) == sorted(before)
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor), key
    torch.testing.assert_close(hf_logits(tmp_path / "hf"), megatron, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("folder", ["legacy_grouped", "dist_grouped"])
@pytest.mark.parametrize("name", ["ep2", "tp2_moe"])
def test_ckpt_grouped_gemm_experts_convert_bitwise(real, tmp_path, name, folder):
    """megatron-core's legacy grouped-GEMM experts (GroupedMLP, moe_grouped_gemm): per-rank files hold each rank's
    experts in two matrices (``experts.weight1`` / ``weight2``), torch_dist the same global expert tensors as
    SequentialMLP; both convert back to the HF model bitwise, split over EP or TP ranks."""
    from rl_ckpt.mcore_io import load_rank

    cases, out = real
    if folder == "legacy_grouped":  # megatron-core wrote GroupedMLP's matrices, not SequentialMLP's experts
        _, state = load_rank(next((out / name / folder).rglob("model_optim_rng.pt")))
        assert "decoder.layers.0.mlp.experts.weight1" in state and not any(".local_experts." in k for k in state)
    ckpt = open_mcore_checkpoint(out / name / folder)
    assert ckpt.spec.num_experts == 4
    convert_mcore_to_hf(ckpt, tmp_path / "hf")
    before, after = load_state(cases[name].hf_dir), load_state(tmp_path / "hf")
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[key], before[key]) for key in before)


def test_ckpt_rl_ckpt_rank_files_equal_megatron_own(real):
    """rl-ckpt's HF -> Megatron files hold exactly megatron-core's keys, shapes and values (``_extra_state`` aside)."""
    from rl_ckpt.mcore_io import load_rank

    _, out = real
    ranks_of = {"tp2": ["mp_rank_00", "mp_rank_01"], "pp2": ["mp_rank_00_000", "mp_rank_00_001"],
                "ep2": ["mp_rank_00_000", "mp_rank_00_001"],  # ep2: mp_rank_<TP>_<EP>, each its experts
                "tp2_moe": ["mp_rank_00", "mp_rank_01"],  # each its half of every expert
                "vpp2": ["mp_rank_00_000", "mp_rank_00_001"]}  # vpp2: model0 and model1 in each  # fmt: skip
    for name, ranks in ranks_of.items():
        for rank, chunk in ((r, c) for r in ranks for c in ((0, 1) if name == "vpp2" else (None,))):
            _, ours = load_rank(out / name / "rl_ckpt" / "iter_0000001" / rank / "model_optim_rng.pt", chunk=chunk)
            _, theirs = load_rank(iter_dir(real, name, "legacy") / rank / "model_optim_rng.pt", chunk=chunk)
            assert sorted(ours) == sorted(theirs), (rank, chunk)
            assert all(torch.equal(ours[k], theirs[k]) for k in ours), (rank, chunk)


@pytest.mark.parametrize("fmt", FORMATS)
def test_ckpt_real_args_alone_need_vocab_size_and_guess_the_family(real, fmt):
    """Megatron-LM's args record neither the unpadded vocabulary nor the HF model type (case tp1: the args'
    tokenizer_model folder is not on this machine)."""
    _, out = real
    with pytest.raises(CheckpointError, match="--vocab_size"):
        open_mcore_checkpoint(out / "tp1" / fmt)
    ckpt = open_mcore_checkpoint(out / "tp1" / fmt, vocab_size=VOCAB)
    assert ckpt.spec.model_type == "qwen3" and ckpt.spec.hf_config is None  # guessed from qk_layernorm


def test_ckpt_real_legacy_cli_in_a_clean_process(real, tmp_path):
    """A fresh interpreter converts a real rank file (numpy RNG state, enums in args) without --trust_checkpoint,
    and never imports megatron: no code from the file ran."""
    _, out = real
    script = (
        "import sys; from rl_ckpt.cli import main; "
        f"code = main(['convert', '--checkpoint_path', {str(out / 'tp2' / 'legacy')!r}, "
        f"'--output_path', {str(tmp_path / 'hf')!r}, '--verify']); "
        "print('megatron imported:', 'megatron' in sys.modules); sys.exit(code)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "megatron imported: False" in done.stdout
    assert "verify: max abs logits difference" in done.stdout and "OK" in done.stdout


def test_ckpt_real_dist_cli_verify(real, tmp_path, capsys):
    _, out = real
    code = main(["convert", "--checkpoint_path", str(out / "pp2" / "dist"), "--output_path", str(tmp_path), "--verify"])
    assert code == 0
    assert "verify: max abs logits difference" in capsys.readouterr().out


def test_ckpt_real_missing_pieces_are_named(real, tmp_path):
    _, out = real
    legacy = shutil.copytree(out / "tp2" / "legacy", tmp_path / "legacy")
    rank1 = legacy / f"iter_{ITERATION:07d}" / "mp_rank_01" / "model_optim_rng.pt"
    rank1.unlink()
    with pytest.raises(CheckpointError, match="missing rank file") as err:
        open_mcore_checkpoint(legacy)
    assert str(rank1) in str(err.value)
    shutil.rmtree(rank1.parent)  # the folder names now say TP=1, the args TP=2
    with pytest.raises(CheckpointError, match="missing rank file"):
        open_mcore_checkpoint(legacy)

    dist = shutil.copytree(out / "tp2" / "dist", tmp_path / "dist")
    data = dist / f"iter_{ITERATION:07d}" / "__1_0.distcp"
    data.unlink()
    with pytest.raises(CheckpointError, match="missing data file") as err:
        open_mcore_checkpoint(dist)
    assert str(data) in str(err.value)
    (dist / f"iter_{ITERATION:07d}" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"no \.metadata"):
        open_mcore_checkpoint(dist)


def test_ckpt_real_dist_streams_one_layer_at_a_time(real, tmp_path, monkeypatch):
    """When layer i is planned, no plan (views of the chunks) made for an earlier piece (embedding, layers < i) is
    alive: the writer holds the plans of one output shard at most, and reads their bytes only then."""
    _, out = real
    real_view = DcpFolder.view
    live: dict[int, int] = {}
    violations: list[str] = []

    def tracking_view(self, key, index=None):
        layer = index if index is None or isinstance(index, int) else index[0]  # (layer, ...) of stacked tensors
        piece = -1 if layer is None and key.startswith("embedding") else (10**6 if layer is None else layer)
        if any(n for p, n in live.items() if p < piece):
            violations.append(f"reading {key}[{index}] with {live}")
        tensor = real_view(self, key, index)
        live[piece] = live.get(piece, 0) + 1
        weakref.finalize(tensor, lambda p=piece: live.__setitem__(p, live[p] - 1))
        return tensor

    monkeypatch.setattr(DcpFolder, "view", tracking_view)
    convert_mcore_to_hf(open_mcore_checkpoint(out / "tp2" / "dist"), tmp_path, max_shard_size=1)
    assert violations == []
    assert sorted(live) == [-1, 0, 1, 2, 3, 10**6]


def test_ckpt_dist_with_optimizer_state_and_whole_tensor_chunks(real, tmp_path):
    """A DCP folder laid out differently from megatron's (one chunk per tensor: every layer read cuts the same
    chunk) and holding a training run's optimizer entries, which are not the model and are ignored."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    cases, _ = real
    source = iter_dir(real, "tp2", "dist")
    folder = DcpFolder(source)
    state = {key: folder.read(key) for key in folder.tensors}
    fc2 = state["decoder.layers.mlp.linear_fc2.weight"]
    state["optimizer.state.exp_avg.decoder.layers.mlp.linear_fc2.weight"] = torch.zeros_like(fc2)
    out = tmp_path / "ckpt" / f"iter_{ITERATION:07d}"
    save(state, storage_writer=FileSystemWriter(str(out)), no_dist=True)
    for name in ("common.pt", "metadata.json"):
        shutil.copy(source / name, out / name)
    assert all(len(entry.chunks) == 1 for entry in DcpFolder(out).tensors.values())
    convert_mcore_to_hf(open_mcore_checkpoint(out), tmp_path / "hf")
    before, after = load_state(cases["tp2"].hf_dir), load_state(tmp_path / "hf")
    assert sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)
