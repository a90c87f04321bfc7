"""A GSPO run from the hybrid Qwen3.5 fixture checkpoint through `loop.run` (what
`python -m gspo_jax.main --config=configs/qwen35_gsm8k.py:...` calls): 2 steps with the
continuous engine on fewer slots than the batch's sequences (slots refilled, their
DeltaNet states reset from the prompts' prefill), sampler and trainer log-probs agreeing,
the exported policy loading back. The static engine's greedy samples are checked against
transformers in tests/models/test_qwen35.py."""

import json

import numpy as np
import pytest
from helpers import metrics_by_step

from configs import qwen35_gsm8k
from gspo_jax import models
from gspo_jax.trainer import loop


def _config(tmp_path):
    manual = tmp_path / "gsm8k"
    manual.mkdir()
    lines = [
        {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3+4=7\n#### 7"},
        {"question": "A box holds 5 pens. How many pens in 2 boxes?", "answer": "5*2=10\n#### 10"},
    ]
    for split in ("train", "test"):
        (manual / f"{split}.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    c = qwen35_gsm8k.get_config(f"hf_path=tests/fixtures/models/qwen35,manual_dir={manual}")
    c.model.tokenizer_path = "tests/fixtures/models/tokenizer"
    c.model.dtype = "float32"
    c.model.remat = "none"
    c.data.data_dir = str(tmp_path / "data")
    c.num_steps = 2
    c.rollout_batch_size, c.num_return_sequences_in_group = 4, 2
    c.num_mini_batches, c.micro_batch_size = 1, None
    c.prompt_length, c.response_length = 192, 6
    c.sampling.prompt_buckets = (192,)
    c.sampling.engine, c.sampling.num_slots = "continuous", 3  # 8 sequences through 3 slots
    c.eval.num_prompts = c.eval.batch_size = 2
    c.checkpoint.every_steps = 0
    c.reward.num_workers = 0
    c.log.progress_bar = c.log.plot = c.log.tensorboard = False
    c.optim.learning_rate, c.optim.weight_decay = 1e-3, 0.1
    return c


@pytest.mark.slow
def test_a_gspo_run_from_the_qwen35_fixture(tmp_path):
    c = _config(tmp_path)
    loop.run(c, str(tmp_path / "run"))
    rows = metrics_by_step(tmp_path / "run")
    assert rows[2]["policy/optimizer_step"] == 2 and np.isfinite(rows[2]["policy/loss"])
    assert rows[2]["sampler/logprob_gap_max"] < 1e-4  # recurrent decode vs chunked trainer
    cfg, _ = models.load_pretrained(tmp_path / "run" / "hf")
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
