"""EngineConfig: every knob of the engine, with defaults that suit the backend."""
from __future__ import annotations

import dataclasses
import os

from jlight.core.moe_impls import MOE_IMPLS
from jlight.engine.speculative import SpeculativeConfig
from jlight.pallas_kernels.matmul_reference import FP8_W8A8_MIN_ROWS


def default_compilation_cache_dir() -> str | None:
    """$JLIGHT_COMPILATION_CACHE_DIR if set ("" for none), else $JLIGHT_CACHE/xla (default ~/.cache/jlight/xla)."""
    if "JLIGHT_COMPILATION_CACHE_DIR" in os.environ:
        return os.environ["JLIGHT_COMPILATION_CACHE_DIR"] or None
    return os.path.join(os.environ.get("JLIGHT_CACHE") or os.path.expanduser("~/.cache/jlight"), "xla")


@dataclasses.dataclass
class EngineConfig:
    model: str | None = None  # None: the default SmolLM2-135M-Instruct
    dtype: str = "auto"
    # None, "int8" (weight-only), "w8a8" (int8 activations too) or "fp8" (float8_e4m3fn weights, one scale per
    # output channel: W8A8-FP8 or weight-only by fp8_w8a8_min_rows). A checkpoint stored quantized (jlight
    # convert, a HF FP8 checkpoint) runs as stored with None or its own mode. "mxfp4": an MXFP4 checkpoint's
    # experts (gpt-oss) kept as stored, 4 bits a weight, expanded where the expert matmuls read them; None expands
    # them to the model dtype at load.
    quantization: str | None = None
    # fp8 weights: steps of at least this many rows (tokens) quantize their activations per token to e4m3
    # and multiply fp8 x fp8 (XLA's fp8 gemm, the fp8 tensor cores on Hopper); smaller ones (decode) upcast
    # the weights inside a bf16 dot. 0: W8A8-FP8 at every step; a value above max_num_batched_tokens:
    # weight-only always. The default (64) is a placeholder until the crossover is measured on the H200
    # (benchmarks/kernel_bench.py fp8).
    fp8_w8a8_min_rows: int = FP8_W8A8_MIN_ROWS
    # Steps of at most this many tokens run jlight's C++ decode attention on the CPU (pallas_kernels/cpu_ffi.py:
    # compiled once per machine with the C++ compiler, one device); larger steps (prefill) run the XLA
    # reference, whose query blocks share their page reads. 0: no C++ kernel at all (GGUF weights dequantized).
    cpu_kernel_max_rows: int = 16
    # Steps of at most this many rows multiply kept GGUF weights in the C++ kernel, larger ones dequantize them
    # and run XLA's dot. Over SmolLM2's layers (2 cores) the kernel took 30.7 / 96.3 / 191.9 / 326.7 ms at
    # 16 / 64 / 128 / 256 rows, the dequantize-and-dot 155.7 / 188.9 / 242.1 / 334.5 ms.
    gguf_kernel_max_rows: int = 256
    # A GGUF file's Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q5_K / Q6_K linear weights on the CPU. "auto": kept as the file
    # stores them, the K-quants as their sub-blocks (0.6-1.25 bytes a weight instead of float32's 4: batch-1 decode
    # reads a third to a sixth of the bytes) and multiplied in float32 by the CPU kernel
    # (pallas_kernels/gguf_matmul_cpu.py), where the CPU kernels run (above) and no quantization is asked; else
    # dequantized. "dequantize": every weight dequantized to the model dtype at load
    # (what GPUs and meshes always do).
    gguf_weights: str = "auto"
    mesh: str | None = None  # e.g. "tp=2"; None: one device
    max_model_len: int | None = None  # default: the model's context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # default: 512 on CPU, 2048 on GPU
    # Smallest compiled step (tokens); smaller steps are padded up to it. None: 8, and on the CPU a
    # 1-token step besides (batch-1 decode: the CPU's matmul time follows the rows, ~2.5x the tokens/s
    # of padding to 8 for SmolLM2). On the H200 a one-token step is slower than an eight-token one
    # (XLA's one-row matmuls; docs/BENCHMARKS.md).
    min_token_bucket: int | None = None
    # Step sizes (tokens) compiled beside the powers of two, e.g. (192,): a step of 129-192 tokens then runs a
    # 192-token step, not a 256-token one. A GPU's matmuls are compute-bound from some 190 rows (bf16 on the
    # H200), so the padded rows of a decode step of 129-255 sequences cost their FLOPs. Each size is one more
    # compiled step (two where it has a narrow-table variant); sizes from max_num_batched_tokens up are left out.
    extra_token_buckets: tuple[int, ...] = ()
    page_size: int = 16
    # default: sized from kv_cache_memory_fraction (or gpu_memory_utilization); a start keeps the size the last
    # start of the same engine chose when its own is near it (startup.settled_pages), so that it runs the same programs
    num_pages: int | None = None
    kv_cache_memory_fraction: float = 0.8  # of the device memory left after the weights
    # vLLM's knob, in vLLM's meaning: the engine's whole share of the card's memory. JAX's allocator manages
    # XLA_PYTHON_CLIENT_MEM_FRACTION of the card (75% unless set) from its start, so an engine created before
    # JAX starts sets that variable to this share (startup.claim_device_memory); one created later gets at
    # most the allocator's limit (logged). When given, the KV pool takes that share less what the weights
    # and the largest step use, and kv_cache_memory_fraction is unused.
    gpu_memory_utilization: float | None = None
    # "auto": K/V pages in the model's dtype; "fp8": float8_e4m3fn values with scale 1 (half a bf16
    # cache's bytes; Llama/MoE families, not MLA); "int8": int8 values + a float32 scale per token and
    # KV head (about half the bytes, so about twice the pages). Llama/MoE families; not MLA. On GPU
    # int8 pages of 32 or 64 tokens run the Mosaic GPU attention, pages of 8 or 16 the Triton one
    # (H200, B=64 decode at 4k context: 324 / 313 vs 343 us; docs/BENCHMARKS.md).
    kv_cache_dtype: str = "auto"
    # With kv_cache_dtype="fp8", the Mosaic GPU prefill kernel quantizes each step's queries to e4m3 (one scale per
    # query head) and runs Q K^T on the fp8 tensor cores instead of converting K to float16
    # (pallas_kernels/paged_prefill_mosaic.py, fp8_qk; it costs up to 2**-4 relative error per query value).
    # Other kernels, the XLA reference and the CPU ignore it. Off by default: the kernel runs faster so, and the
    # quantized queries double the fp8 cache's perplexity cost (docs/BENCHMARKS.md, quantization quality).
    fp8_prefill_qk: bool = False
    enable_prefix_caching: bool = True
    # GiB of host memory for the K/V of pages the prefix cache evicts (vLLM's kv_offloading_size; host_tier.py):
    # they are copied there instead of dropped, and copied back when a later prompt's prefix needs them.
    # None: off. Needs prefix caching.
    kv_offloading_size: float | None = None
    # How the host tier's pinned pages travel (host_tier.COPIES): "in_program" (the gather writes them to pinned
    # memory and the scatter reads them from there, inside the programs) or "device_put" (a gather on the device,
    # then jax.device_put to pinned memory, a page at a time; back the same way before the scatter). On an H100's
    # multi-turn chat in_program's restoring turns reached their first token 15-16% sooner and the tier's sync took
    # 17-22 ms where device_put's took 65-71 (docs/BENCHMARKS.md, the host KV tier).
    kv_offloading_copies: str = "in_program"
    # vLLM's knob: True keeps every page of every layer, as for a model without attention kinds. False (the
    # default): a model whose layers differ in kind (sliding windows beside full attention: Gemma 2/3, gpt-oss)
    # keeps a page table per group of layers of one kind, and its sliding-window layers give back the pages
    # their window no longer sees (kv_groups.py); num_pages then counts pages of one group's layers. The host
    # tier and disaggregated prefill/decode move one table of pages, so they use the one-group pool.
    disable_hybrid_kv_cache_manager: bool = False
    attention_impl: str = "auto"
    matmul_impl: str = "auto"
    # MoE experts: "auto" (the Pallas grouped matmul on GPU; elsewhere gathered at small decode
    # batches, else ragged_dot; models/moe.py), or force "pallas", "ragged_dot", "gathered", "dense".
    moe_impl: str = "auto"
    # "scan": one compiled layer body looped over stacked weights (fast compiles, but each step slices
    # every layer's weights out of the stack: a copy of the weights per step on the CPU);
    # "unroll": one body per layer over per-layer weights. "auto": unroll, for families that can.
    layer_loop: str = "auto"
    # An unrolled loop traces and lowers layers alike once, as one function each layer calls (XLA inlines
    # it: the same compiled program), not each layer anew: a 32-layer step lowers several times faster, so
    # a start that compiles its buckets spends less of its serial (Python) time on them. False: each layer traced.
    trace_layers_once: bool = True
    # The steps take the params' small vectors (norm weights, biases, sinks) grouped into one array a dtype,
    # sliced back inside the step (param_packing.py): every array a call passes costs host time at each launch,
    # and a model of many layers has hundreds of them (gpt-oss-20b 411, of which ~200 such vectors). Off until
    # measured on a GPU against the step's own time.
    pack_small_params: bool = False
    # A step that asks for prompt logprobs gets them from a second, small program the host launches after it,
    # over the step's final hidden states (ModelRunner._prompt_logprobs_program), instead of from a branch of the
    # step under a lax.cond. That branch loops over the chunks, and a conditional holding a loop may run outside
    # XLA:GPU's command buffers, where it copies its predicate to the host and waits: a long step's launch would
    # return only once the device had nearly run it. The pool's sizing counts the step's memory, not that
    # program's (one chunk's full-vocabulary logits), which compiles at its bucket's first use. Off until measured
    # on a GPU.
    prompt_logprobs_program: bool = False
    # One matmul for q/k/v and one for gate/up (models/layers.fuse_projections): fewer, wider
    # matmuls, so fewer kernel launches per step. Single device only (a mesh keeps them apart).
    # With layer_loop="scan" fusing copies each stacked group once at start-up (transient memory).
    fuse_projections: bool = True
    # Ring collective matmuls for steps of >= 256 tokens under tp (sharding/collective_matmul.py). Off:
    # on the H200s it did not speed up a 2048-token prefill at tp=2 (136.0 vs 135.3 ms) and made it
    # 1.46x slower at tp=4 (114.2 vs 78.2 ms; Llama-3-70B shape, docs/BENCHMARKS.md), compiling 7x longer.
    collective_matmul: bool = False
    int8_all_reduce: bool = False
    # Speculative decoding (jlight/engine/speculative.py, proposers/), vLLM's speculative_config: e.g.
    # {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}, or
    # {"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}. None: off.
    speculative_config: dict | None = None
    # Whether a step that verifies drafts runs as XLA's command buffers (CUDA graphs), as every other step does.
    # The host waits for such a step before it drafts and launches the next, so nothing hides its launch: as
    # a command buffer the device starts only once the host has updated the whole graph (on the H200 an 8B
    # verify step waited 2.9 ms for it), while launched kernel by kernel the device starts at the first kernel
    # and keeps pace with the host. None: GPUs with speculative decoding compile each step bucket a second time
    # without command buffers, for the verify steps; elsewhere XLA makes none and there is nothing to choose.
    # True: no second variant. False: the second variant on any backend (where XLA has no command buffers, as
    # on the CPU, it is the same program: for tests).
    verify_step_command_buffers: bool | None = None
    # Whether a proposer that drafts ahead (n-gram) gets rows in the next step before the step in flight is read
    # back (speculative.py). On a GPU the host's launch of the next step then overlaps the device's step (batch 1,
    # an 8B model on the H200: 1.127 ms/token against 1.699 read back first). On the CPU the step runs on the
    # host's own cores, so nothing overlaps and a row discarded after a rejection costs a whole step (SmolLM2 on
    # two cores, copying a passage: 1.68-1.85x speculation off's speed, against 2.01-2.09x read back first).
    # None: on GPUs only.
    draft_ahead: bool | None = None
    # Disaggregated prefill and decode (disaggregated.py): "prefill=N,decode=M", a prefill engine on the first N
    # devices and a decode engine on the next M, each tensor parallel over its group. None: one engine.
    disaggregated: str | None = None
    # Disaggregated prefill and decode as two processes (disaggregated_roles.py): "prefill" or "decode", this process's
    # role in a pair joined by jax.distributed (disaggregated_roles.join_pair first); its engine takes every device of
    # this process. None: no role.
    disaggregated_role: str | None = None
    # Seconds the prefill process holds a handoff's pages for the decode side to ask for them, and the decode side
    # waits for pages it asked for, before giving up (the decode side then recomputes the prompt).
    kv_transfer_timeout_s: float = 300.0
    seed: int = 0
    warmup: bool = True
    # Steps compiled at once at start-up (XLA compiles outside Python's lock); None: one per CPU core, at most
    # the number of steps (a bucket can make two or four: ModelRunner.num_step_variants). 1: one after the other.
    compile_threads: int | None = None
    # JAX's persistent compilation cache: a warm start loads its compiled steps from here instead of
    # compiling them. Default $JLIGHT_COMPILATION_CACHE_DIR ("" for none), else $JLIGHT_CACHE/xla.
    compilation_cache_dir: str | None = dataclasses.field(default_factory=default_compilation_cache_dir)
    # Keep each compiled step bucket under compilation_cache_dir/executables (executable_store.py): a warm
    # start loads them and skips tracing and lowering as well as compiling. Needs compilation_cache_dir.
    store_executables: bool = True

    def validate(self) -> "EngineConfig":
        def bad(field, why):
            raise ValueError(f"{field}={getattr(self, field)!r} is invalid: {why}")

        if self.max_num_seqs < 1:
            bad("max_num_seqs", "must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            bad("max_num_batched_tokens", f"must be >= max_num_seqs ({self.max_num_seqs}) so every running sequence can decode each step")
        if self.min_token_bucket is not None and (self.min_token_bucket < 1 or self.min_token_bucket & (self.min_token_bucket - 1)):
            bad("min_token_bucket", "must be a power of two >= 1 (or None for the default)")
        if not isinstance(self.extra_token_buckets, (tuple, list)) or not all(
                isinstance(e, int) and not isinstance(e, bool) and e >= 1 for e in self.extra_token_buckets):
            bad("extra_token_buckets", "must be a tuple of step sizes in tokens, each an int >= 1")
        self.extra_token_buckets = tuple(self.extra_token_buckets)
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            bad("page_size", "must be a power of two")
        if self.num_pages is not None and self.num_pages < 2:
            bad("num_pages", "must be >= 2 (page 0 is reserved)")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            bad("kv_cache_memory_fraction", "must be in (0, 1]")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            bad("gpu_memory_utilization", "must be in (0, 1]")
        if self.quantization not in (None, "int8", "w8a8", "fp8", "mxfp4"):
            bad("quantization", "must be None, 'int8', 'w8a8', 'fp8' or 'mxfp4'")
        if self.fp8_w8a8_min_rows < 0:
            bad("fp8_w8a8_min_rows", "must be >= 0 (0: W8A8-FP8 at every step)")
        if self.gguf_weights not in ("auto", "dequantize"):
            bad("gguf_weights", "must be 'auto' (kept as stored on the CPU) or 'dequantize'")
        if self.cpu_kernel_max_rows < 0:
            bad("cpu_kernel_max_rows", "must be >= 0 (0: the XLA references always)")
        if self.gguf_kernel_max_rows < 0:
            bad("gguf_kernel_max_rows", "must be >= 0 (0: GGUF weights dequantized at every step)")
        if self.kv_cache_dtype not in ("auto", "fp8", "int8"):
            bad("kv_cache_dtype", "must be 'auto' (the model's dtype), 'fp8' (e4m3) or 'int8'")
        if not isinstance(self.fp8_prefill_qk, bool):
            bad("fp8_prefill_qk", "must be True or False")
        if self.fp8_prefill_qk and self.kv_cache_dtype != "fp8":
            bad("fp8_prefill_qk", f"needs kv_cache_dtype='fp8' (got {self.kv_cache_dtype!r}): it multiplies queries by fp8 K pages")
        if self.moe_impl not in MOE_IMPLS:
            bad("moe_impl", f"must be one of {', '.join(MOE_IMPLS)}")
        if self.layer_loop not in ("auto", "scan", "unroll"):
            bad("layer_loop", "must be 'auto', 'scan' or 'unroll'")
        if self.kv_offloading_copies not in ("device_put", "in_program"):
            bad("kv_offloading_copies", "must be 'device_put' or 'in_program'")
        if self.kv_offloading_size is not None:
            if not self.kv_offloading_size > 0:
                bad("kv_offloading_size", "must be > 0 GiB (or None for no host tier)")
            if not self.enable_prefix_caching:
                bad("kv_offloading_size", "needs prefix caching (the host tier holds the prefix cache's evicted pages); "
                    "turn enable_prefix_caching on or leave kv_offloading_size unset")
        if self.compile_threads is not None and self.compile_threads < 1:
            bad("compile_threads", "must be >= 1 (or None: one per CPU core)")
        if self.max_model_len is not None and self.max_model_len < 2:
            bad("max_model_len", "must be >= 2")
        if self.disaggregated is not None and self.mesh:
            bad("disaggregated", f"takes the devices of each role itself; leave mesh ({self.mesh!r}) unset")
        if self.disaggregated_role not in (None, "prefill", "decode"):
            bad("disaggregated_role", "must be 'prefill' or 'decode' (or None)")
        if self.disaggregated_role is not None and (self.mesh or self.disaggregated):
            bad("disaggregated_role", "takes every device of its process itself; leave mesh and disaggregated unset")
        if not self.kv_transfer_timeout_s > 0:
            bad("kv_transfer_timeout_s", "must be > 0 seconds")
        spec = SpeculativeConfig.from_dict(self.speculative_config)  # raises naming the key
        if spec is not None and spec.method != "ngram":
            # A proposer's model runs on one device, its K/V in pages the host tier and the prefill/decode handover
            # do not carry (proposers/device.py).
            for field, what in (("mesh", "a mesh"), ("kv_offloading_size", "the host KV tier"),
                                ("disaggregated", "disaggregated prefill/decode"),
                                ("disaggregated_role", "disaggregated prefill/decode")):
                if getattr(self, field):
                    bad(field, f"speculative_config.method={spec.method!r} does not run with {what} yet; leave {field} "
                        "unset or use method 'ngram'")
        return self

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.from_dict(self.speculative_config)
