"""The TRL-anchor workload, written once for both sides of the comparison.

`benchmarks/rl_step.py --preset=trl_anchor` (gspo_jax) and `benchmarks/trl_anchor.py` (TRL,
in a separate torch venv) import this module, so the model, the prompts, the tokenizer and
the reward are the same on both sides. It imports neither jax nor torch: only `tokenizers`
and `transformers`, which both environments have.

Workload (TRL's GSPO example geometry): Qwen2 architecture, hidden 256, 4 layers, 4 query /
2 KV heads of 64, MLP 688, vocabulary 1,024, tied embeddings, f32 (3.17M parameters),
random weights. Per RL step 4 prompts x 8 samples, prompts left padded to 16 tokens, 64 new
tokens at temperature 1, reward on the decoded text, group z-score advantages, GSPO
sequence ratio (ε 3e-4 / 4e-4), per-sequence token mean then mean over sequences, β = 0,
one optimizer update per rollout, AdamW lr 1e-6 with grad-norm clip 1.0.
"""

from __future__ import annotations

import itertools
import random
import string

MODEL = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 64,
    "tie_word_embeddings": True,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
}
NUM_PROMPTS = 4
GROUP = 8
PROMPT_LEN = 16  # prompts are left padded to this many tokens
RESPONSE_LEN = 64
TEMPERATURE = 1.0
CLIP_LOW, CLIP_HIGH = 3e-4, 4e-4
LEARNING_RATE = 1e-6
MAX_GRAD_NORM = 1.0

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>")  # pad, -, eos, unk
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"


def vocabulary() -> list[str]:
    """1,024 token strings: the 4 ChatML specials, 100 characters, then 920 two-character
    tokens (so a random model's output decodes to ordinary text)."""
    pairs = ("".join(p) for p in itertools.product(string.ascii_letters + string.digits, repeat=2))
    extra = MODEL["vocab_size"] - len(SPECIALS) - len(CHARS)
    return [*SPECIALS, *CHARS, *itertools.islice(pairs, extra)]


def make_tokenizer():
    """A Hugging Face fast tokenizer over `vocabulary()` (character-level encoding, left
    padding, eos <|im_end|>, pad <|endoftext|>), built in memory: nothing is downloaded."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {token: i for i, token in enumerate(vocabulary())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIALS[3]))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=SPECIALS[2],
        pad_token=SPECIALS[0],
        unk_token=SPECIALS[3],
        padding_side="left",
    )


def prompts(seed: int = 0) -> list[str]:
    """NUM_PROMPTS prompt texts of 8 to PROMPT_LEN characters (one token per character); the
    first is PROMPT_LEN long, so padding to the longest (TRL) gives PROMPT_LEN columns."""
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + " "
    lengths = [PROMPT_LEN] + [rng.randint(8, PROMPT_LEN) for _ in range(NUM_PROMPTS - 1)]
    return ["".join(rng.choice(alphabet) for _ in range(n)) for n in lengths]


def reward(completion: str) -> float:
    """The reward on decoded text: the fraction of its characters that are digits."""
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)


def model_flops_per_step(num_params_matmul: int) -> dict[str, float]:
    """Model FLOPs of one RL step (the same count for both sides; benchmarks/common.py's
    model: 2·N per token and layer stack, 2·D·V per token with logits, 4·layers·H·C per
    causal (query, key) pair; backward = 2 x forward).

    generation: one causal forward over the B = N·G rows of P + T tokens with logits on the
    T response tokens (what a KV-cached sampler computes); train: 3 x that forward.
    """
    m = MODEL
    rows, length = NUM_PROMPTS * GROUP, PROMPT_LEN + RESPONSE_LEN
    attention = 4.0 * m["num_layers"] * m["num_heads"] * m["head_dim"] * (length / 2)
    per_row = length * (2.0 * num_params_matmul + attention)
    per_row += RESPONSE_LEN * 2.0 * m["hidden_size"] * m["vocab_size"]
    forward = rows * per_row
    return {"generation": forward, "train": 3 * forward, "step": 4 * forward}


def matmul_params() -> int:
    """Weights one token multiplies in the layer stack (q, k, v, o and the MLP)."""
    m = MODEL
    d, h, k, c = m["hidden_size"], m["num_heads"], m["num_kv_heads"], m["head_dim"]
    f = m["intermediate_size"]
    return m["num_layers"] * (2 * d * h * c + 2 * d * k * c + 3 * d * f)
