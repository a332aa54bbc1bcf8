"""ROLL's VLTrajEnvManager (issue 23): Sokoban and FrozenLake episodes whose observations are their grids drawn as
pictures (``render_mode: rgb_array``), played by a tiny Qwen2.5-VL. Each turn's message holds the current frame as
the model's vision block; the episode's sample carries every picture of its context, so the train role scores the
sampled tokens as the inference engine sampled them. Bad combinations are refused naming the key."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from agentic_fixtures import InProcessGroup
from PIL import Image

from apps.agentic.config import AgenticConfig
from apps.agentic.env_manager import EnvManager
from apps.agentic.envs import make_env
from apps.agentic.vision import VisionTrajectoryRunner, load_vl_processor
from apps.common.preflight import fill_model_paths
from apps.common.yaml_config import load_config
from rl_engines.config import WorkerConfig, WorkerConfigError
from rl_engines.role_worker import RoleWorker
from rl_engines.strategies import create_strategy
from rl_engines.tiny_model import build_tiny_vl_model
from rl_engines.vision import VISUAL_KEY, encode_images
from rl_engines.worker_group import WorkerBase

CONFIG = """\
seed: 5
pretrain: MODEL
sequence_length: 2000
max_tokens_per_step: 5
actor_train: {device_mapping: [0]}
actor_infer: {device_mapping: [0], strategy_args: {strategy_name: hf_infer}}
train_env_manager: {num_env_groups: 2, group_size: 1, tags: [SimpleSokoban, FrozenLake]}
env_manager_cls: roll.pipeline.agentic.env_manager.vl_traj_env_manager.VLTrajEnvManager
pre_step_template: "\\nTurn {turn_idx}:\\nState:\\n"
next_step_template: "\\nYou have {actions_left} actions left, {max_response_length} tokens. Decide:"
custom_envs:
  SimpleSokoban:
    env_type: sokoban
    max_steps: 2
    env_manager_cls: ${env_manager_cls}
    pre_step_template: ${pre_step_template}
    next_step_template: ${next_step_template}
    env_config: {dim_room: [5, 5], num_boxes: 1, max_steps: 2, search_depth: 6, render_mode: rgb_array}
  FrozenLake:
    env_type: frozen_lake
    max_steps: 2
    env_manager_cls: ${env_manager_cls}
    pre_step_template: ${pre_step_template}
    next_step_template: ${next_step_template}
    env_config: {is_slippery: false, max_steps: 2, render_mode: rgb_array}
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("agentic_vl")
    corpus = ["<answer>Up</answer> <answer>Down</answer> <answer>Left</answer> <answer>Right</answer>"]
    corpus += [make_env(kind).instructions for kind in ("frozen_lake", "sokoban")]
    build_tiny_vl_model(root / "vl", corpus, vocab_size=500)
    (root / "agentic.yaml").write_text(CONFIG.replace("MODEL", str(root / "vl")))
    return root


def test_vl_episodes_show_the_rendered_grids_and_their_samples_score_as_sampled(setup):
    config = AgenticConfig.from_dict(load_config(setup / "agentic.yaml"))
    fill_model_paths(config.base)
    worker = RoleWorker("actor_infer", 0, 1, "127.0.0.1", WorkerBase.free_port(), {}, config.base.actor_infer)
    worker.initialize()
    processor = load_vl_processor(str(setup / "vl"), "actor_infer")
    manager = EnvManager(config, config.train_env_manager, "train")
    generating = replace(config.base.actor_infer.generating_args, temperature=1.0)
    runner = VisionTrajectoryRunner(manager, worker.strategy.tokenizer, generating, 2000, processor)
    try:
        episodes = runner.run(InProcessGroup(worker), step=0)
    finally:
        manager.close()
    image_pad = worker.strategy.model.config.image_token_id
    for episode in episodes:
        # a picture per user turn: the first frame, then the frame after each step that another turn follows
        assert len(episode.pictures) == len(episode.rewards) >= 1
        pads = sum(int(p["image_grid_thw"].prod()) // 4 for p in episode.pictures)
        assert (episode.prompt_ids + episode.tokens).count(image_pad) == pads > 0
        fresh = make_env(episode.slot.spec.env_type, episode.slot.spec.env_config)
        fresh.reset(episode.seed)  # the environment's first frame, drawn, through the model's image processor
        first = encode_images(processor, [Image.fromarray(fresh.render("rgb_array"))])
        assert torch.equal(episode.pictures[0]["pixel_values"], first["pixel_values"])
    assert {episode.slot.tag for episode in episodes} == {"SimpleSokoban", "FrozenLake"}

    batch = runner.to_batch(episodes)
    assert [len(sample["image_grid_thw"]) for sample in batch.non_tensor_batch[VISUAL_KEY]] == [
        len(episode.pictures) for episode in episodes
    ]
    train = WorkerConfig.from_dict({"model_args": {"model_name_or_path": str(setup / "vl")}}, "actor_train")
    strategy = create_strategy(train, "actor_train")
    strategy.initialize()
    scored = strategy.compute_log_probs(batch).batch["log_probs"]
    mask = batch.batch["response_mask"]
    # generation's log-probs (KV cache, the pictures of the context at each turn) agree with one fresh forward of
    # the whole episode with all its pictures
    torch.testing.assert_close(scored[mask], batch.batch["rollout_log_probs"][mask], atol=1e-4, rtol=0)


def test_each_turn_shows_the_frame_after_the_last_move(setup):
    """The next user turn holds the picture of the state the move led to, after the earlier ones: the context's
    pictures are the episode's frames in order."""
    from transformers import AutoTokenizer

    config = AgenticConfig.from_dict(load_config(setup / "agentic.yaml"))
    processor = load_vl_processor(str(setup / "vl"), "actor_infer")
    tokenizer = AutoTokenizer.from_pretrained(str(setup / "vl"))
    manager = EnvManager(config, config.train_env_manager, "train")
    runner = VisionTrajectoryRunner(manager, tokenizer, config.base.actor_infer.generating_args, 2000, processor)
    slot = next(slot for slot in manager.slots if slot.tag == "SimpleSokoban")
    episode = runner._start(slot, 7, 0, slot.env.reset(7))
    before = slot.env.render("rgb_array")
    for move in ("Up", "Down", "Left", "Right"):  # a move that changes the room
        result = slot.env.step(f"<answer>{move}</answer>")
        if not (slot.env.render("rgb_array") == before).all():
            break
    episode.observation = result.observation
    runner._next_context(episode, [], 1)
    manager.close()
    frames = [before, slot.env.render("rgb_array")]
    expected = [encode_images(processor, [Image.fromarray(frame)])["pixel_values"] for frame in frames]
    assert len(episode.pictures) == 2 and not torch.equal(expected[0], expected[1])
    assert all(torch.equal(p["pixel_values"], e) for p, e in zip(episode.pictures, expected, strict=True))
    pads = sum(int(p["image_grid_thw"].prod()) // 4 for p in episode.pictures)
    assert episode.context.count(tokenizer.convert_tokens_to_ids("<|image_pad|>")) == pads


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c["custom_envs"]["SimpleSokoban"].pop("env_manager_cls"),
         r"custom_envs\.SimpleSokoban\.env_config\.render_mode=rgb_array makes the observations pictures"),
        (lambda c: c["custom_envs"]["FrozenLake"].pop("pre_step_template"),
         r"custom_envs\.FrozenLake\.pre_step_template is not set"),
        (lambda c: c["custom_envs"]["FrozenLake"]["env_config"].update(render_mode="rgb"),
         r"render_mode='rgb': use one of \['text', 'rgb_array'\]"),
    ],
)  # fmt: skip
def test_what_the_vl_env_manager_cannot_run_is_refused_naming_the_key(setup, change, message):
    raw = copy.deepcopy(load_config(setup / "agentic.yaml"))
    change(raw)

    def start() -> None:  # what the pipeline does before Ray starts: the config, then the environments
        config = AgenticConfig.from_dict(raw)
        EnvManager(config, config.train_env_manager, "train").close()

    with pytest.raises((WorkerConfigError, ValueError), match=message):
        start()


def test_a_text_model_under_the_vl_env_manager_is_refused_naming_the_key(tmp_path):
    from rl_engines.tiny_model import build_tiny_causal_lm, build_tiny_tokenizer

    build_tiny_tokenizer(tmp_path, ["a b c"], vocab_size=300)
    build_tiny_causal_lm(tmp_path, vocab_size=303)
    with pytest.raises(ValueError, match=r"actor_infer\.model_args\.model_name_or_path=.* is not a vision-language"):
        load_vl_processor(str(tmp_path), "actor_infer")
