"""Draft model: a smaller model of the target's vocabulary proposes, run by the engine's own model code.

vLLM's `{"method": "draft_model", "model": PATH, "num_speculative_tokens": k}`. The draft model is any
checkpoint jlight runs (a family of models/), loaded and prepared as the target's weights are (single
device, unquantized). Its first pass is its prefill: the step's tokens as the target ran them, so its K/V
follow the target's page for page; its chain is k greedy decode steps from the token sampled after
each row's kept tokens (device.py).
"""
from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from jlight import loading
from jlight.engine.engine_config import EngineConfig
from jlight.engine.proposers.device import DeviceProposer
from jlight.engine.speculative import SpeculativeConfig
from jlight.engine.weights import prepare_params, unrolls
from jlight.models import get_model_family


class DraftModelProposer(DeviceProposer):
    num_first_drafts = 0
    shifted = False

    def __init__(self, config: SpeculativeConfig, family, model_config, params, dtype, target_vocab_size: int):
        super().__init__(config, params, dtype)
        self.family, self.model_config = family, model_config
        self.vocab_size = target_vocab_size  # drafts are target token ids: the draft's logits beyond it are cut

    def pool_shapes(self, num_pages: int, page_size: int):
        return self.family.kv_cache_shapes(self.model_config, num_pages, page_size)

    def first_pass(self, params, k_cache, v_cache, tokens, hidden, md, kept):
        _, k_cache, v_cache = self.family.forward(params, self.model_config, tokens, k_cache, v_cache, md, self.kernels, self.ops)
        return k_cache, v_cache, None, None

    def chain_step(self, params, k_cache, v_cache, tokens, hidden, md):
        h, k_cache, v_cache = self.family.forward(params, self.model_config, tokens, k_cache, v_cache, md, self.kernels, self.ops)
        logits = self.family.compute_logits(params, self.model_config, h, self.kernels, self.ops)[:, : self.vocab_size]
        return k_cache, v_cache, jnp.argmax(logits, axis=-1).astype(jnp.int32), None


def load_draft_model(spec: SpeculativeConfig, cfg: EngineConfig, target_config, target_tokenizer, dtype,
                     gpu: bool) -> DraftModelProposer:
    """The draft model at spec.model, in the target's compute dtype; ValueError naming
    speculative_config.model when it cannot serve as the target's draft."""
    path = os.path.expanduser(spec.model)
    if not os.path.exists(path):
        raise ValueError(f"speculative_config.model={spec.model!r} does not exist; give the draft model's directory "
                         "(config.json and safetensors) or GGUF file")
    loaded = loading.load_model(path, dtype=jnp.dtype(dtype).name, unstacked=unrolls(cfg, None, gpu))
    draft = loaded.config
    if draft.vocab_size != target_config.vocab_size or not same_vocabulary(loaded.tokenizer, target_tokenizer):
        raise ValueError(
            f"speculative_config.model={spec.model!r} does not share the target's vocabulary (draft {draft.vocab_size} "
            f"tokens, target {target_config.vocab_size}, or different tokenizers): a draft model must use the target's "
            "tokenizer; pick a smaller model of the target's own series")
    family = get_model_family(draft)
    if hasattr(family, "state_shapes"):
        raise ValueError(f"speculative_config.model={spec.model!r} is a hybrid model ({draft.architecture}), whose "
                         "recurrent state cannot take back rejected drafts; pick an attention-only draft model")
    draft_cfg = dataclasses.replace(cfg, quantization=None, mesh=None)
    params, _ = prepare_params(draft_cfg, family, loaded, None, gpu, owns_weights=True)
    return DraftModelProposer(spec, family, draft, params, dtype, target_config.vocab_size)


def same_vocabulary(draft_tokenizer, target_tokenizer) -> bool:
    """Whether two tokenizers map the same strings to the same ids (True when either is unknown)."""
    if draft_tokenizer is None or target_tokenizer is None:
        return True
    return draft_tokenizer.backend.get_vocab(with_added_tokens=True) == target_tokenizer.backend.get_vocab(with_added_tokens=True)
