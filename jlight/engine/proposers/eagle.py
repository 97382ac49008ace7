"""EAGLE heads as proposers: vLLM's `{"method": "eagle" | "eagle3", "model": HEAD_DIR, "num_speculative_tokens": k}`.

The head (models/eagle.py) reads the target's hidden state at a position with the embedding of the token
after it. Its first pass runs over the step's tokens, each paired with its successor (the sampled token
where the step sampled: a verified row's kept drafts and bonus token), and the target's final hidden
states (EAGLE-1) or the residual streams of three of its layers (EAGLE-3, tapped by the step); a row's
first draft comes from the head's output at its last kept token. Each chained draft then reads the
previous draft and the head's own output (device.py).
"""
from __future__ import annotations

import os

from jlight.engine.engine_config import EngineConfig
from jlight.engine.model_runner import Taps
from jlight.engine.proposers.device import DeviceProposer
from jlight.engine.speculative import SpeculativeConfig
from jlight.engine.weights import unrolls
from jlight.loading.spec_heads import load_eagle_head
from jlight.models import eagle


class EagleProposer(DeviceProposer):
    num_first_drafts = 1
    shifted = True

    def __init__(self, config: SpeculativeConfig, head_config, head: eagle.EagleHead, params, dtype, taps: Taps):
        super().__init__(config, params, dtype)
        self.head_config, self.head, self.taps = head_config, head, taps

    def pool_shapes(self, num_pages: int, page_size: int):
        return eagle.kv_cache_shapes(self.head_config, num_pages, page_size)

    def first_pass(self, params, k_cache, v_cache, tokens, hidden, md, kept):
        h, k_cache, v_cache = eagle.forward(params, self.head_config, self.head, tokens, hidden, k_cache, v_cache, md,
                                            self.kernels, self.ops, from_target=True)
        h = h[kept.flat]  # [B, embed] at each row's last kept token
        return k_cache, v_cache, eagle.draft_tokens(params, self.head_config, self.head, h, self.kernels, self.ops), h

    def chain_step(self, params, k_cache, v_cache, tokens, hidden, md):
        h, k_cache, v_cache = eagle.forward(params, self.head_config, self.head, tokens, hidden, k_cache, v_cache, md,
                                            self.kernels, self.ops, from_target=False)
        return k_cache, v_cache, eagle.draft_tokens(params, self.head_config, self.head, h, self.kernels, self.ops), h


def load_eagle(spec: SpeculativeConfig, cfg: EngineConfig, target_family, target_config, target_params, dtype,
               gpu: bool) -> EagleProposer:
    """The EAGLE-1 (method "eagle") or EAGLE-3 ("eagle3") head at spec.model for the target; ValueError naming
    speculative_config when it cannot serve the target."""
    path = os.path.expanduser(spec.model)
    eagle3 = spec.method == "eagle3"
    if not os.path.isdir(path):
        raise ValueError(f"speculative_config.model={spec.model!r} is not a directory; give the EAGLE head's directory "
                         "(config.json and safetensors)")
    if eagle3 and not (hasattr(target_family, "forward_tapping") and unrolls(cfg, target_family, gpu)):
        raise ValueError(f"speculative_config.method='eagle3' reads the target's inner layers, which jlight taps for "
                         f"Llama-family targets with unrolled layers; {target_config.architecture} with "
                         f"layer_loop={cfg.layer_loop!r} is not one (use method 'eagle' or 'draft_model', or layer_loop='unroll')")
    try:
        head_config, head, layers, params = load_eagle_head(path, eagle3, target_config, dtype)
    except ValueError as e:
        raise ValueError(f"speculative_config.model={spec.model!r}: {e}") from None
    params.setdefault("embed", target_params["embed"])  # shared with the target (EAGLE-3 may have its own)
    params.setdefault("lm_head", target_params["lm_head"])  # EAGLE-1's logits are the target's
    taps = Taps(layers=layers) if eagle3 else Taps(hidden=True)
    return EagleProposer(spec, head_config, head, params, dtype, taps)
