"""Speculative proposers, one module each, behind the interface of base.py: n-gram prompt lookup on the
host (ngram.py); a draft model (draft_model.py), EAGLE-1 / EAGLE-3 heads (eagle.py) and DeepSeek's MTP
layer (mtp.py) on the device, over device.py's machinery."""
from __future__ import annotations

from jlight.engine.engine_config import EngineConfig
from jlight.engine.proposers.base import Proposer
from jlight.engine.proposers.draft_model import load_draft_model
from jlight.engine.proposers.eagle import load_eagle
from jlight.engine.proposers.mtp import load_mtp
from jlight.engine.proposers.ngram import NgramProposer
from jlight.engine.speculative import SpeculativeConfig


def make_proposer(spec: SpeculativeConfig | None, cfg: EngineConfig, family, model_config, params, tokenizer, kv_dtype,
                  num_kv_groups: int, gpu: bool) -> Proposer | None:
    """The proposer speculative_config names, for the target model (its family, config, prepared params,
    tokenizer, compute dtype and number of KV groups); None without speculative decoding."""
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec)
    if num_kv_groups > 1:
        raise ValueError(f"speculative_config.method={spec.method!r}: the proposer's K/V follow one page table, and "
                         f"{model_config.architecture} keeps a table per attention kind; set "
                         "disable_hybrid_kv_cache_manager=True (or use method 'ngram')")
    if spec.method in ("eagle", "eagle3"):
        return load_eagle(spec, cfg, family, model_config, params, kv_dtype, gpu)
    if spec.method in ("deepseek_mtp", "mtp"):
        return load_mtp(spec, cfg, model_config, params, kv_dtype)
    return load_draft_model(spec, cfg, model_config, tokenizer, kv_dtype, gpu)
