"""Speculative decoding with model proposers (jlight/engine/proposers/): a draft model, EAGLE-1 and EAGLE-3
heads and DeepSeek's MTP layer, on tiny float32 models. Greedy tokens equal speculation off through the whole
engine (batched beside a request that does not speculate, chunked prefill, prefix caching, preemption, n=2);
a draft identical to the target keeps every draft (drafting and its K/V are in step with the target); the
heads' drafts equal a torch reference of their published computation; bad configs name their key and fix.

The checkpoints are written here in their published layouts: a layer-skip draft is the target's HF checkpoint
cut to its first layers; EAGLE heads use the tensor names of yuhuili's EAGLE-1 / EAGLE-3 releases; the MTP
layer is model.layers.{num_hidden_layers}.* inside the DeepSeek-V3 checkpoint."""
import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import jlight
from jlight import SamplingParams

# Eight sequences of ~100 tokens preempt each other in 47 pages of 8 tokens; chunks of 32 tokens; one step bucket
# (32 tokens) to compile per engine: drafting and verifying do not depend on the bucket a step pads to.
ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=32, page_size=8, num_pages=48, min_token_bucket=32)
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def write_layer_skip_draft(target_dir: str, out_dir: str, num_layers: int) -> str:
    """The target's checkpoint with only its first num_layers layers (a self-speculative draft)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(target_dir, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = num_layers
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(target_dir, name), out_dir)
    tensors = load_file(os.path.join(target_dir, "model.safetensors"))
    kept = {n: t for n, t in tensors.items() if not n.startswith("model.layers.") or int(n.split(".")[2]) < num_layers}
    save_file(kept, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def random_prompts(n: int, seed: int, vocab: int = 500) -> list[list[int]]:
    """Random prompts of 5 to 60 tokens, two of three repeating a phrase."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        phrase = rng.integers(3, vocab, int(rng.integers(4, 12))).tolist()
        out.append(phrase * int(rng.integers(2, 4)) if i % 3 else rng.integers(3, vocab, int(rng.integers(5, 60))).tolist())
    return out


def token_ids(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def spec_counts(llm, before):
    s = llm.engine.stats()
    return (s.spec_num_drafts - before.spec_num_drafts, s.spec_num_draft_tokens - before.spec_num_draft_tokens,
            s.spec_num_accepted_tokens - before.spec_num_accepted_tokens)


@pytest.fixture(scope="module")
def target_dir(tiny_model):
    return tiny_model("LlamaForCausalLM", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def plain(target_dir):
    return jlight.LLM(target_dir, **ENGINE)


def check_matches_plain(plain, spec, prompts, kept_some: bool = True):
    """Greedy tokens equal the engine's without speculation: for the first two prompts, then for a batch of the
    others after two that extend those (prefix-cache hits), the last one with a repetition penalty (it never
    speculates) and one with n=2. The batch preempted, hit the prefix cache and verified drafts."""
    before = spec.engine.stats()
    batch = [prompts[0] + prompts[3][:9], prompts[1][:16] + [7, 7, 7]] + prompts[2:]
    params = [GREEDY] * (len(batch) - 2) + [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2),
                                            SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3)]
    for prompts, params in ((prompts[:2], GREEDY), (batch, params)):
        want = token_ids(plain.generate(prompts, params, use_tqdm=False))
        assert token_ids(spec.generate(prompts, params, use_tqdm=False)) == want
    stats = spec.engine.stats()
    rows, drafts, accepted = spec_counts(spec, before)
    assert rows > 0 and accepted < drafts
    assert accepted > 0 or not kept_some
    assert stats.num_preemptions > before.num_preemptions
    assert stats.prefix_cache_hit_tokens > before.prefix_cache_hit_tokens
    return drafts, accepted


# --- draft model ----------------------------------------------------------------------------

def test_draft_model_identical_to_the_target_keeps_every_draft(target_dir):
    """Drafting right and its K/V in step with the target's: a draft that is the target keeps every draft."""
    spec = jlight.LLM(target_dir, **ENGINE, speculative_config={"method": "draft_model", "model": target_dir,
                                                                "num_speculative_tokens": 3})
    prompts = random_prompts(6, seed=5)
    before = spec.engine.stats()
    spec.generate(prompts, GREEDY, use_tqdm=False)
    rows, drafts, accepted = spec_counts(spec, before)
    assert rows > 20 and accepted / drafts > 0.97, (rows, drafts, accepted)


def test_layer_skip_draft_model_gives_the_targets_greedy_tokens(target_dir, plain, tmp_path):
    draft = write_layer_skip_draft(target_dir, str(tmp_path / "draft"), num_layers=1)
    spec = jlight.LLM(target_dir, **ENGINE, speculative_config={"method": "draft_model", "model": draft,
                                                                "num_speculative_tokens": 3})
    check_matches_plain(plain, spec, random_prompts(10, seed=1))


@pytest.mark.parametrize("config, message", [
    ({"method": "medusa", "model": "x"},
     "speculative_config.method='medusa' is not supported; supported: ngram, draft_model, eagle, eagle3, deepseek_mtp, mtp"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "speculative_config.model is missing: method 'eagle3'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model is missing"),
    ({"method": "ngram", "model": "x"}, "speculative_config.model='x' is not used by method 'ngram'"),
])
def test_bad_model_configs_name_the_key_and_the_fix(config, message):
    from jlight.engine.speculative import SpeculativeConfig

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig.from_dict(config)


def test_a_draft_model_that_is_missing_or_of_another_vocabulary_is_refused(target_dir, tiny_model):
    with pytest.raises(ValueError, match="speculative_config.model='/nonexistent/draft' does not exist"):
        jlight.LLM(target_dir, **ENGINE, speculative_config={"method": "draft_model", "model": "/nonexistent/draft"})
    other = tiny_model("LlamaForCausalLM", vocab_size=384)
    with pytest.raises(ValueError, match="does not share the target's vocabulary .*draft 384 tokens, target 512"):
        jlight.LLM(target_dir, **ENGINE, warmup=False, speculative_config={"method": "draft_model", "model": other})
    with pytest.raises(ValueError, match="mesh='tp=2' is invalid: speculative_config.method='draft_model' does not run"):
        jlight.LLM(target_dir, **ENGINE, mesh="tp=2", speculative_config={"method": "draft_model", "model": target_dir})


def test_heads_for_another_target_or_without_their_tensors_are_refused(target_dir, tmp_path):
    wide = write_eagle_head(str(tmp_path / "wide"), target_dir, eagle3=True)
    with open(os.path.join(wide, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(wide, "config.json"), "w") as f:
        json.dump(dict(config, target_hidden_size=128), f)
    with pytest.raises(ValueError, match="speculative_config.model=.*: it is a head for another target: vocabulary 512, hidden size 128"):
        jlight.LLM(target_dir, **ENGINE, warmup=False, speculative_config={"method": "eagle3", "model": wide})
    head = write_eagle_head(str(tmp_path / "eagle"), target_dir, eagle3=False)
    tensors = load_file(os.path.join(head, "model.safetensors"))
    del tensors["layers.0.mlp.down_proj.weight"]
    save_file(tensors, os.path.join(head, "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing its layer's \['w_down'\]; expected layers.0.\* tensors"):
        jlight.LLM(target_dir, **ENGINE, warmup=False, speculative_config={"method": "eagle", "model": head})
    with pytest.raises(ValueError, match="method='deepseek_mtp' runs DeepSeek-V3's MTP layer, and LlamaForCausalLM has none"):
        jlight.LLM(target_dir, **ENGINE, warmup=False, speculative_config={"method": "deepseek_mtp"})


# --- EAGLE heads ------------------------------------------------------------------------------

def _hf_config(target_dir: str) -> dict:
    with open(os.path.join(target_dir, "config.json")) as f:
        return json.load(f)


def write_eagle_head(out_dir: str, target_dir: str, eagle3: bool, seed: int = 0, draft_vocab: int = 200,
                     aux_layers=(0, 1, 2), exact: bool = False) -> str:
    """An EAGLE-1 or EAGLE-3 head for the target at target_dir, in the published layout (safetensors names of
    yuhuili/EAGLE-LLaMA3-Instruct-8B and yuhuili/EAGLE3-LLaMA3.1-Instruct-8B), random weights.
    exact (EAGLE-1): fc passes the token's embedding through and the layer adds nothing, so the head's logits are
    the target's lm_head over the next token's embedding."""
    t = _hf_config(target_dir)
    E, F, V = t["hidden_size"], t["intermediate_size"], t["vocab_size"]
    H, KV = t["num_attention_heads"], t["num_key_value_heads"]
    D = E // H
    rng = np.random.default_rng(seed)
    w = lambda *shape: (rng.normal(0, 1, shape) / np.sqrt(shape[-1])).astype(np.float32)
    cfg = dict(architectures=["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLM"], model_type="llama",
               hidden_size=E, intermediate_size=F, num_attention_heads=H, num_key_value_heads=KV, num_hidden_layers=1,
               rms_norm_eps=t["rms_norm_eps"], rope_theta=(t.get("rope_parameters") or t)["rope_theta"], max_position_embeddings=t["max_position_embeddings"],
               vocab_size=V, tie_word_embeddings=False, torch_dtype="float32")
    prefix = "midlayer." if eagle3 else "layers.0."
    qkv_in = 2 * E if eagle3 else E
    tensors = {prefix + "self_attn.q_proj.weight": w(H * D, qkv_in), prefix + "self_attn.k_proj.weight": w(KV * D, qkv_in),
               prefix + "self_attn.v_proj.weight": w(KV * D, qkv_in), prefix + "self_attn.o_proj.weight": w(E, H * D),
               prefix + "mlp.gate_proj.weight": w(F, E), prefix + "mlp.up_proj.weight": w(F, E),
               prefix + "mlp.down_proj.weight": w(E, F),
               prefix + "post_attention_layernorm.weight": (1 + 0.2 * rng.normal(size=E)).astype(np.float32),
               "embed_tokens.weight": load_file(os.path.join(target_dir, "model.safetensors"))["model.embed_tokens.weight"]}
    if eagle3:
        cfg.update(draft_vocab_size=draft_vocab, eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_layers)})
        ids = np.sort(rng.choice(V, draft_vocab, replace=False))  # the draft vocabulary: target ids
        t2d = np.zeros(V, bool)
        t2d[ids] = True
        tensors.update({"fc.weight": w(E, 3 * E), prefix + "input_layernorm.weight": (1 + 0.2 * rng.normal(size=E)).astype(np.float32),
                        prefix + "hidden_norm.weight": (1 + 0.2 * rng.normal(size=E)).astype(np.float32),
                        "norm.weight": (1 + 0.2 * rng.normal(size=E)).astype(np.float32), "lm_head.weight": w(draft_vocab, E),
                        "d2t": (ids - np.arange(draft_vocab)).astype(np.int64), "t2d": t2d})
    else:
        tensors.update({"fc.weight": w(E, 2 * E), "fc.bias": (0.1 * rng.normal(size=E)).astype(np.float32)})
        if exact:
            tensors["fc.weight"] = np.concatenate([np.eye(E), np.zeros((E, E))], axis=1).astype(np.float32)
            tensors["fc.bias"] = np.zeros(E, np.float32)
            tensors[prefix + "self_attn.o_proj.weight"][:] = 0
            tensors[prefix + "mlp.down_proj.weight"][:] = 0
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _rms(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope(x, positions, theta):
    """HF Llama's rotate-half RoPE. x: [T, heads, D]."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = positions[:, None].double() * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None].float(), torch.cat([ang.sin(), ang.sin()], -1)[:, None].float()
    half = torch.cat([-x[..., D // 2:], x[..., : D // 2]], -1)
    return x * cos + half * sin


class TorchEagleHead:
    """The published EAGLE-1 / EAGLE-3 head computation written from its checkpoint's tensors alone (the
    reference the engine's drafts are held to); keeps its K/V of every position it ran."""

    def __init__(self, head_dir: str, target_dir: str, eagle3: bool):
        self.t = {k: torch.from_numpy(v) for k, v in load_file(os.path.join(head_dir, "model.safetensors")).items()}
        self.target = {k: torch.from_numpy(v) for k, v in load_file(os.path.join(target_dir, "model.safetensors")).items()}
        self.cfg, self.eagle3 = _hf_config(head_dir), eagle3
        self.p = "midlayer." if eagle3 else "layers.0."
        self.keys, self.values = [], []

    def layer(self, tokens, hidden, positions, from_target):
        t, p, c = self.t, self.p, self.cfg
        eps, H, KV = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"]
        D = c["hidden_size"] // H
        e = self.target["model.embed_tokens.weight"][tokens]
        if self.eagle3:
            if from_target:
                hidden = hidden @ t["fc.weight"].T
            normed = _rms(hidden, t[p + "hidden_norm.weight"], eps)
            x, residual = torch.cat([_rms(e, t[p + "input_layernorm.weight"], eps), normed], -1), hidden
        else:
            x = torch.cat([e, hidden], -1) @ t["fc.weight"].T + t["fc.bias"]
            residual = x
        q = _rope((x @ t[p + "self_attn.q_proj.weight"].T).view(-1, H, D), positions, c["rope_theta"])
        k = _rope((x @ t[p + "self_attn.k_proj.weight"].T).view(-1, KV, D), positions, c["rope_theta"])
        self.keys.append(k)
        self.values.append((x @ t[p + "self_attn.v_proj.weight"].T).view(-1, KV, D))
        keys, values = torch.cat(self.keys).repeat_interleave(H // KV, 1), torch.cat(self.values).repeat_interleave(H // KV, 1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) / D ** 0.5
        all_positions = torch.arange(keys.shape[0])  # every position so far, in order
        scores = scores.masked_fill(all_positions[None, None, :] > positions[None, :, None], float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(len(tokens), -1)
        h = residual + attn @ t[p + "self_attn.o_proj.weight"].T
        m = _rms(h, t[p + "post_attention_layernorm.weight"], eps)
        m = torch.nn.functional.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T)
        return h + m @ t[p + "mlp.down_proj.weight"].T

    def draft(self, h):
        if not self.eagle3:
            return int((h @ self.target["lm_head.weight"].T).argmax())
        best = int((_rms(h, self.t["norm.weight"], self.cfg["rms_norm_eps"]) @ self.t["lm_head.weight"].T).argmax())
        return best + int(self.t["d2t"][best])

    def drafts_after(self, prompt, first_token, features, k):
        """The head's k drafts after a prompt whose target features are `features` and whose greedy next token is
        first_token: the first pass over the prompt, then k - 1 chained drafts."""
        tokens = torch.tensor(prompt[1:] + [first_token])
        h = self.layer(tokens, features, torch.arange(len(prompt)), from_target=True)[-1:]
        out = [self.draft(h[0])]
        for i in range(1, k):
            h = self.layer(torch.tensor(out[-1:]), h, torch.tensor([len(prompt) + i - 1]), from_target=False)
            out.append(self.draft(h[0]))
        return out


def target_features(target_dir: str, prompt, eagle3: bool, aux_layers=(0, 1, 2)):
    """(the target's greedy token after the prompt, its hidden states there as the head reads them: the final normed
    ones for EAGLE-1, the residual streams entering aux_layers for EAGLE-3) from transformers."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    captured = []
    hook = model.model.layers[-1].register_forward_hook(lambda mod, args, out: captured.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_hidden_states=True)
    hook.remove()
    streams = list(out.hidden_states[:-1]) + [captured[0]]  # entering layer i; after the last, before the final norm
    features = torch.cat([streams[i][0] for i in aux_layers], -1) if eagle3 else out.hidden_states[-1][0]
    return int(out.logits[0, -1].argmax()), features


def drafts_after_prefill(llm, prompt):
    """The engine's first token after `prompt` and the drafts its proposer made in the same step."""
    engine = llm.engine
    rid = engine.add_request(None, None, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), prompt_token_ids=prompt)
    seq = engine.requests[rid].seqs[0]
    while not seq.output_token_ids:
        engine.step()
    first, drafts = seq.output_token_ids[0], list(seq.draft_tokens)
    engine.abort_request(rid)
    engine.run_to_completion()
    return first, drafts


@pytest.fixture(scope="module")
def eagle_engines(target_dir, tmp_path_factory):
    """method -> (LLM with that head over the tiny target, the head's directory)."""
    root = tmp_path_factory.mktemp("eagle_heads")
    out = {}
    for method in ("eagle", "eagle3"):
        head = write_eagle_head(str(root / method), target_dir, eagle3=method == "eagle3", seed=len(method))
        out[method] = jlight.LLM(target_dir, **ENGINE, speculative_config={"method": method, "model": head,
                                                                           "num_speculative_tokens": 3}), head
    return out


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_heads_give_the_targets_greedy_tokens(eagle_engines, plain, method):
    check_matches_plain(plain, eagle_engines[method][0], random_prompts(10, seed=2), kept_some=False)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_drafts_equal_the_published_heads_computation(eagle_engines, target_dir, method):
    """Prompts of two prefill chunks (a chunk's last token reads the next chunk's first) and their drafts: the
    head's first pass over the prompt's target features, then chained drafts reading the head's K/V of every
    position before them. The torch reference reads the checkpoint's tensors by their names."""
    llm, head_dir = eagle_engines[method]
    rng = np.random.default_rng(7)
    for length in (33, 36, 40):
        prompt = rng.integers(3, 500, length).tolist()
        first, drafts = drafts_after_prefill(llm, prompt)
        want_first, features = target_features(target_dir, prompt, method == "eagle3")
        assert first == want_first
        assert drafts == TorchEagleHead(head_dir, target_dir, method == "eagle3").drafts_after(prompt, first, features, 3)


# --- DeepSeek MTP -----------------------------------------------------------------------------

MTP_NAMES = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
             "embed_tokens.weight")


def write_mtp_checkpoint(target_dir: str, out_dir: str, seed: int = 0) -> str:
    """The tiny DeepSeek-V3 checkpoint with an MTP layer, as DeepSeek-V3 publishes it: num_nextn_predict_layers 1 and
    model.layers.{num_hidden_layers}.* (enorm, hnorm, eh_proj, shared_head.{norm, head}, embed_tokens and a
    decoder layer: here the last layer's tensors, perturbed)."""
    shutil.copytree(target_dir, out_dir)
    config = _hf_config(target_dir)
    config["num_nextn_predict_layers"] = 1
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    L, E, V = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    rng = np.random.default_rng(seed)
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    last = f"model.layers.{L - 1}."
    for name, t in list(tensors.items()):
        if name.startswith(last):
            noise = rng.normal(0, 0.2 * (float(np.abs(t).mean()) or 1.0), t.shape) if t.dtype.kind == "f" else 0
            tensors[f"model.layers.{L}." + name[len(last):]] = (t + noise).astype(t.dtype)
    mtp = f"model.layers.{L}."
    tensors.update({mtp + "enorm.weight": (1 + 0.2 * rng.normal(size=E)).astype(np.float32),
                    mtp + "hnorm.weight": (1 + 0.2 * rng.normal(size=E)).astype(np.float32),
                    mtp + "eh_proj.weight": (rng.normal(size=(E, 2 * E)) / np.sqrt(2 * E)).astype(np.float32),
                    mtp + "shared_head.norm.weight": (1 + 0.2 * rng.normal(size=E)).astype(np.float32),
                    mtp + "shared_head.head.weight": (rng.normal(size=(V, E)) / np.sqrt(E)).astype(np.float32),
                    mtp + "embed_tokens.weight": tensors["model.embed_tokens.weight"]})
    save_file(tensors, path, metadata={"format": "pt"})
    return out_dir


@pytest.fixture(scope="module")
def deepseek_engines(tiny_moe_model, tmp_path_factory):
    """(checkpoint with an MTP layer, engine without speculation, engine with method deepseek_mtp)."""
    target, _ = tiny_moe_model("DeepseekV3ForCausalLM")
    path = write_mtp_checkpoint(target, str(tmp_path_factory.mktemp("mtp") / "deepseek"))
    return (path, jlight.LLM(path, **ENGINE),
            jlight.LLM(path, **ENGINE, speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 3}))


def test_a_deepseek_checkpoint_without_its_mtp_layer_is_refused(tiny_moe_model):
    target, _ = tiny_moe_model("DeepseekV3ForCausalLM")
    with pytest.raises(ValueError, match="method='mtp': .* has no MTP layer tensors .*model.layers.3.*num_nextn_predict_layers"):
        jlight.LLM(target, **ENGINE, warmup=False, speculative_config={"method": "mtp"})


def test_deepseek_mtp_gives_the_targets_greedy_tokens(deepseek_engines):
    _, plain_ds, spec = deepseek_engines
    check_matches_plain(plain_ds, spec, random_prompts(10, seed=3, vocab=256), kept_some=False)


def reference_mtp_drafts(path: str, prompt, k: int):
    """transformers' greedy token after the prompt and the MTP layer's k drafts, the layer run as a one-layer
    DeepseekV3 model (its decoder layer, shared_head.norm as the final norm, shared_head.head as lm_head) over
    inputs_embeds = eh_proj(concat(enorm(embed(next token)), hnorm(hidden))), the whole sequence at every draft."""
    import transformers

    target = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True)
    first, hidden = int(out.logits[0, -1].argmax()), out.hidden_states[-1][0]
    config = _hf_config(path)
    L = config["num_hidden_layers"]
    t = {k: torch.from_numpy(v) for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
    mtp = f"model.layers.{L}."
    layer = {"model.layers.0." + n[len(mtp):]: v for n, v in t.items() if n.startswith(mtp) and n[len(mtp):] not in MTP_NAMES}
    one = dict(layer, **{"model.norm.weight": t[mtp + "shared_head.norm.weight"], "lm_head.weight": t[mtp + "shared_head.head.weight"],
                         "model.embed_tokens.weight": t["model.embed_tokens.weight"]})
    ref_dir = path + "_mtp_reference"
    os.makedirs(ref_dir, exist_ok=True)
    with open(os.path.join(ref_dir, "config.json"), "w") as f:
        json.dump(dict(config, num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=0), f)
    save_file({n: v.numpy() for n, v in one.items()}, os.path.join(ref_dir, "model.safetensors"), metadata={"format": "pt"})
    head = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    eps, embed = config["rms_norm_eps"], t["model.embed_tokens.weight"]

    def x_of(token, h, position):
        e = embed[token] * (position > 0)
        return torch.cat([_rms(e, t[mtp + "enorm.weight"], eps), _rms(h, t[mtp + "hnorm.weight"], eps)]) @ t[mtp + "eh_proj.weight"].T

    xs = [x_of(tok, hidden[i], i) for i, tok in enumerate(prompt[1:] + [first])]
    captured = []
    hook = head.model.layers[0].register_forward_hook(lambda mod, args, o: captured.append(o[0] if isinstance(o, tuple) else o))
    drafts = []
    with torch.no_grad():
        for i in range(k):
            captured.clear()
            logits = head(inputs_embeds=torch.stack(xs)[None]).logits[0, -1]
            drafts.append(int(logits.argmax()))
            xs.append(x_of(drafts[-1], captured[0][0, -1], len(prompt) + i))
    hook.remove()
    return first, drafts


def test_deepseek_mtp_drafts_equal_the_published_layers_computation(deepseek_engines):
    """Prompts of two prefill chunks and their drafts against transformers' DeepSeek-V3 decoder layer run as the
    MTP layer: the tensors load by their published names, the MLA cache of the first pass is what the chain reads."""
    path, _, spec = deepseek_engines
    rng = np.random.default_rng(11)
    for length in (33, 40):
        prompt = rng.integers(3, 256, length).tolist()
        first, drafts = drafts_after_prefill(spec, prompt)
        assert (first, drafts) == reference_mtp_drafts(path, prompt, 3)


# --- larger sweeps (extended) -------------------------------------------------------------------

@pytest.mark.extended
@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3", "deepseek_mtp"])
def test_logprobs_stop_strings_and_seeded_sampling_with_each_proposer(method, target_dir, plain, eagle_engines,
                                                                      deepseek_engines, tmp_path):
    """Greedy logprobs and stop strings equal speculation off; seeded sampling gives the same tokens alone and
    in a batch (the drafts a row verifies do not depend on its neighbours)."""
    if method == "deepseek_mtp":
        _, base, spec = deepseek_engines
        vocab = 256
    elif method == "draft_model":
        draft = write_layer_skip_draft(target_dir, str(tmp_path / "draft"), num_layers=1)
        base, vocab = plain, 500
        spec = jlight.LLM(target_dir, **ENGINE, speculative_config={"method": method, "model": draft, "num_speculative_tokens": 3})
    else:
        base, spec, vocab = plain, eagle_engines[method][0], 500
    prompts = random_prompts(6, seed=9, vocab=vocab)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    want, got = (llm.generate(prompts, params, use_tqdm=False) for llm in (base, spec))
    assert token_ids(got) == token_ids(want)
    for w, g in zip(want, got):
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert lw.keys() == lg.keys()
            np.testing.assert_allclose(list(lg.values()), list(lw.values()), atol=1e-4)
    text = want[0].outputs[0].text
    stop = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop=[text[len(text) // 2: len(text) // 2 + 3]])
    w, g = (llm.generate(prompts[:1], stop, use_tqdm=False)[0].outputs[0] for llm in (base, spec))
    assert (g.text, g.finish_reason) == (w.text, w.finish_reason)
    seeded = SamplingParams(temperature=0.8, top_k=20, max_tokens=24, ignore_eos=True, seed=11)
    alone = [spec.generate([p], seeded, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:2]]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, seeded, use_tqdm=False)][:2] == alone
