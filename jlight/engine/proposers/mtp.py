"""DeepSeek MTP as a proposer: vLLM's `{"method": "deepseek_mtp", "num_speculative_tokens": k}` ("mtp" too).

The checkpoint's multi-token-prediction layer (models/deepseek_mtp.py), read from the target's own
checkpoint unless speculative_config.model names another directory. Like an EAGLE-1 head it reads the
target's final hidden state at each position with the embedding of the token after it: its first pass
runs over the step's tokens and gives each row its first draft; the chained drafts read its own output
(device.py). With num_nextn_predict_layers > 1 the first layer drafts every position.
"""
from __future__ import annotations

import os

from jlight.engine.engine_config import EngineConfig
from jlight.engine.model_runner import Taps
from jlight.engine.proposers.device import DeviceProposer
from jlight.engine.speculative import SpeculativeConfig
from jlight.loading.spec_heads import load_mtp_layer
from jlight.models import deepseek_mtp


class MtpProposer(DeviceProposer):
    num_first_drafts = 1
    shifted = True
    taps = Taps(hidden=True)

    def __init__(self, config: SpeculativeConfig, model_config, params, dtype):
        super().__init__(config, params, dtype)
        self.model_config = model_config

    def pool_shapes(self, num_pages: int, page_size: int):
        return deepseek_mtp.kv_cache_shapes(self.model_config, num_pages, page_size)

    def first_pass(self, params, k_cache, v_cache, tokens, hidden, md, kept):
        h, k_cache, v_cache = deepseek_mtp.forward(params, self.model_config, tokens, hidden, k_cache, v_cache, md,
                                                   self.kernels, self.ops)
        h = h[kept.flat]  # [B, embed] at each row's last kept token
        return k_cache, v_cache, deepseek_mtp.draft_tokens(params, self.model_config, h, self.kernels, self.ops), h

    def chain_step(self, params, k_cache, v_cache, tokens, hidden, md):
        h, k_cache, v_cache = deepseek_mtp.forward(params, self.model_config, tokens, hidden, k_cache, v_cache, md,
                                                   self.kernels, self.ops)
        return k_cache, v_cache, deepseek_mtp.draft_tokens(params, self.model_config, h, self.kernels, self.ops), h


def load_mtp(spec: SpeculativeConfig, cfg: EngineConfig, target_config, target_params, dtype) -> MtpProposer:
    """The target checkpoint's MTP layer (or spec.model's); ValueError naming speculative_config when there is none."""
    if target_config.family != "deepseek":
        raise ValueError(f"speculative_config.method={spec.method!r} runs DeepSeek-V3's MTP layer, and "
                         f"{target_config.architecture} has none; use method 'draft_model', 'eagle' or 'ngram'")
    path = os.path.expanduser(spec.model or cfg.model or "")
    if not os.path.isdir(path):
        raise ValueError(f"speculative_config.method={spec.method!r} reads the MTP layer from a checkpoint directory, and "
                         f"{spec.model or cfg.model!r} is not one; give speculative_config.model (the DeepSeek checkpoint's directory)")
    try:
        params = load_mtp_layer(path, target_config, dtype)
    except ValueError as e:
        raise ValueError(f"speculative_config.method={spec.method!r}: {e}") from None
    params.setdefault("embed", target_params["embed"])  # the layer's embed_tokens copy, else the target's
    return MtpProposer(spec, target_config, params, dtype)
