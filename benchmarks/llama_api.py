"""llama.cpp for the benchmarks that set it beside mtp-trt (benchmarks/beside_llama_cpp.py, quant_quality.py,
serve.py, v2_lite.py): GGUF files made with llama.cpp's own tools, mtp-trt exports of the same checkpoints, and
llama.cpp driven through its C API as its own programs drive it.  It imports no benchmark script (only
benchmarks/bench_common.py).

GGUF files, cached in mtp-trt's cache directory, in bench-real-size (bench_common.cache_dir(); never in git):

* f32: llama.cpp's converter (`convert_hf_to_gguf.py`, unpacked from llama-cpp-python's source distribution)
  run on the Hugging Face checkpoint with `--outtype f32`, in the Python that runs mtp-trt (it needs torch).
  The demo tokenizer's pre-tokenizer is unknown to the converter: it is byte-level BPE with GPT-2's split
  regex, so the converter is told "gpt-2" for it (llama.cpp only sees token ids here: both engines get the
  same prompt ids, starting with BOS).
* q8_0, q4_0, q4_k_m: `llama_model_quantize` from the f32 GGUF (`llama_model_quantize_default_params`,
  ftype LLAMA_FTYPE_MOSTLY_Q8_0 / _Q4_0 / _Q4_K_M), what `llama-quantize <in> <out> Q4_K_M` does, in the
  Python that has llama_cpp.  Tensors whose rows do not fit a type's block fall back to another type as
  llama-quantize decides.
* <name>-mtp-<type>: the same with the checkpoint's first MTP module kept, for llama.cpp's own MTP drafting
  (`llama-speculative-simple --spec-type draft-mtp`).  llama.cpp's converter drops DeepSeek-V3's MTP layer;
  the harness keeps it as its V3.2 converter does (keep_first_mtp_module).  llama.cpp loads the MTP block
  only for a drafting context (on the demo, the main model's tensors are byte for byte those of <name>-<type>
  at every type here).

mtp-trt exports (`ensure_export`), cached beside them, one per --quant: the demo with all its MTP modules, the
random 85m / 304m with nextn 1 and max_seq_len 1024 (as benchmarks/real_size.py exports them).

Decoding (`LlamaEngine`), with llama-cpp-python's ctypes bindings of llama.h and none of its Python `Llama`
class: `llama_model_load_from_file` (default model parameters: the file memory-mapped and read in up front, the
weights of the types llama.cpp's CPU backend repacks copied into its "extra buffer types"; LLAMA_SETTINGS names
the others a benchmark can ask for), `llama_init_from_model` (context of
`n_ctx` rows, `n_threads` = `n_threads_batch` = threads, the rest llama.cpp's defaults), one `llama_batch`
from `llama_batch_init` filled in place (token, position, sequence 0, whether its logits are wanted) as
llama-server fills its batches, `llama_decode`, and a sampler chain (`llama_sampler_chain_init`) holding
only `llama_sampler_init_greedy`, read with `llama_sampler_sample(chain, ctx, -1)` after each decode, as
llama-cli and llama-server sample.  A generation: the memory cleared (`llama_memory_clear`), the prompt in
one decode (logits of its last token only), then one decode per new token.  No Python touches the logits
on that path.  Teacher-forced logits (`logits`): one decode of a whole window with every position's logits
asked for, read with `llama_get_logits`.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_common import cache_dir, peak_rss_mb, read_mapped, revision  # noqa: E402

CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
GGUF_TYPES = {"f32": None, "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
              "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
GGUF_LABELS = {"f32": "f32", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k_m": "Q4_K_M"}
# llama.cpp's model settings as llama-cli / llama-server flags -> (repack, mmap): `--no-repack` keeps the weights
# in the GGUF's layout (no CPU repacked copy: use_extra_bufts false), `--load-mode none` reads the file into
# memory of llama.cpp's own instead of mapping it (use_mmap false in llama-cpp-python before 0.3.36).
LLAMA_SETTINGS = {"default": (True, True), "--no-repack": (False, True), "--load-mode none": (True, False),
                  "--no-repack --load-mode none": (False, False)}


def import_llama():
    """The llama_cpp package (llama-cpp-python), or SystemExit saying how to get it."""
    try:
        import llama_cpp
    except ImportError as e:
        raise SystemExit(f"{sys.executable}: the llama_cpp package cannot be imported ({e}); `pip install "
                         f"llama-cpp-python`, or pass --llama-python with a Python that has it") from None
    missing = [f for f in ("llama_decode", "llama_sampler_chain_init", "llama_model_quantize", "llama_memory_clear",
                           "llama_batch_init", "llama_get_logits") if not hasattr(llama_cpp, f)]
    if missing:
        raise SystemExit(f"llama_cpp {getattr(llama_cpp, '__version__', '?')} at {llama_cpp.__file__} lacks "
                         f"{', '.join(missing)}; these benchmarks need llama-cpp-python >= 0.3.10")
    return llama_cpp


def quiet(ll):
    """llama.cpp's log reduced to its errors (on stderr); returns the callback, to be kept alive."""
    def on_log(level: int, text: bytes, user_data) -> None:
        if level == 4:  # GGML_LOG_LEVEL_ERROR
            sys.stderr.write(text.decode(errors="replace"))

    cb = ll.llama_log_callback(on_log)
    ll.llama_log_set(cb, ctypes.c_void_p(0))
    return cb


# ------------------------------------------------------------------------------------------------- GGUF files
def gguf_path(name: str, kind: str, mtp: bool = False) -> Path:
    """The cached GGUF of checkpoint `name` ("demo", "85m", ...) in type `kind` (GGUF_TYPES); `mtp`: the one
    that keeps the first MTP module (keep_first_mtp_module)."""
    return cache_dir() / f"{name}{'-mtp' if mtp else ''}-{kind}.gguf"


def converter_dir(sdist: Path | None) -> Path:
    """llama.cpp's converter unpacked (once) from the llama-cpp-python source distribution."""
    if sdist is None:
        raise SystemExit("--sdist: llama-cpp-python's source distribution is needed to convert a checkpoint to GGUF "
                         "(pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d DIR)")
    if not sdist.is_file():
        raise SystemExit(f"--sdist {sdist}: no such file (llama-cpp-python's .tar.gz source distribution, which "
                         f"holds llama.cpp's converter)")
    out = cache_dir() / f"llama-convert-{sdist.name.removesuffix('.tar.gz')}"
    if (out / "convert_hf_to_gguf.py").is_file():
        return out
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            rel = m.name.partition("/vendor/llama.cpp/")[2]
            if rel and rel.startswith(CONVERTER_PARTS) and (m.isfile() or m.isdir()):
                m.name = rel
                members.append(m)
        if not any(m.name == "convert_hf_to_gguf.py" for m in members):
            raise SystemExit(f"{sdist}: no vendor/llama.cpp/convert_hf_to_gguf.py inside; expected "
                             f"llama-cpp-python's source distribution")
        tar.extractall(out, members=members, filter="data")
    return out


def keep_first_mtp_module(base) -> None:
    """llama.cpp's converter drops DeepSeek-V3's MTP layers (its DeepseekV2Model skips every layer past
    num_hidden_layers); keep the first one as its DeepSeek-V3.2 converter (DeepseekV32Model) keeps V3.2's: the
    block appended as blk.<num_hidden_layers> (its eh_proj / enorm / hnorm / shared_head.norm as blk.N.nextn.*),
    block_count num_hidden_layers + 1, `<arch>.nextn_predict_layers` 1.  One module only: llama.cpp's DeepSeek
    MTP graph takes a single block (and reuses it at every draft depth); further modules are left out."""
    import conversion.deepseek as deepseek
    import gguf

    class DeepseekV3WithMtp(deepseek.DeepseekV2Model):
        model_arch = gguf.MODEL_ARCH.DEEPSEEK2
        skip_mtp = False

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.hparams.get("num_nextn_predict_layers", 0) < 1:
                raise SystemExit(f"{self.dir_model}: num_nextn_predict_layers is 0, no MTP layer to keep")
            self.block_count = self.hparams["num_hidden_layers"] + 1
            self.tensor_map = gguf.get_tensor_name_map(self.model_arch, self.block_count)

        def set_gguf_parameters(self):
            super().set_gguf_parameters()
            self.gguf_writer.add_nextn_predict_layers(1)

        def modify_tensors(self, data_torch, name, bid):
            if bid is not None and bid >= self.block_count:  # MTP modules past the first
                return
            yield from super().modify_tensors(data_torch, name, bid)

    base.ModelBase.register("DeepseekV3ForCausalLM")(DeepseekV3WithMtp)


def convert_child(src: str, ckpt: str, out: str, outtype: str = "f32", keep_mtp: bool = False) -> dict:
    """(in a child process) llama.cpp's convert_hf_to_gguf.py on `ckpt` (`--outtype` f32, or q8_0 where an f32
    file would not fit the disk), the BPE pre-tokenizer registered; `keep_mtp`: with the checkpoint's first MTP
    module (keep_first_mtp_module)."""
    import runpy

    sys.path[:0] = [src, str(Path(src) / "gguf-py")]
    import conversion.base as base

    if keep_mtp:
        keep_first_mtp_module(base)

    plain = base.TextModel.get_vocab_base_pre

    def vocab_pre(self, tokenizer):
        try:
            return plain(self, tokenizer)
        except NotImplementedError:  # the demo's tokenizer: byte-level BPE, GPT-2's regex
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = vocab_pre
    tmp = f"{out}.partial"
    sys.argv = ["convert_hf_to_gguf.py", ckpt, "--outtype", outtype, "--outfile", tmp]
    t0 = time.perf_counter()
    stdout, sys.stdout = sys.stdout, sys.stderr  # the converter's output must not mix with our JSON line
    try:
        runpy.run_path(str(Path(src) / "convert_hf_to_gguf.py"), run_name="__main__")
    finally:
        sys.stdout = stdout
    os.replace(tmp, out)
    return {"seconds": time.perf_counter() - t0}


def quantize_child(src: str, out: str, kind: str, threads: int, requantize: bool = False,
                   overrides: dict[str, int] | None = None) -> dict:
    """(in a child process, a Python with llama_cpp) the f32 GGUF `src` quantized to `kind` with
    llama_model_quantize, as llama-quantize does (`requantize`: `src` is already quantized, as
    `llama-quantize --allow-requantize`; `overrides`: integer metadata keys read in place of `src`'s and written
    into `out`, as `llama-quantize --override-kv KEY=int:VALUE`)."""
    ll = import_llama()
    log = quiet(ll)
    ll.llama_backend_init()
    params = ll.llama_model_quantize_default_params()
    params.ftype = getattr(ll, GGUF_TYPES[kind])
    params.nthread = threads
    params.allow_requantize = requantize
    if overrides:
        kv = (ll.llama_model_kv_override * (len(overrides) + 1))()  # the last one empty: the list's end
        for o, (key, value) in zip(kv, overrides.items()):
            o.tag, o.key, o.value.val_i64 = ll.LLAMA_KV_OVERRIDE_TYPE_INT, key.encode(), value
        params.kv_overrides = kv
    tmp = f"{out}.partial"
    t0 = time.perf_counter()
    rc = ll.llama_model_quantize(src.encode(), tmp.encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize({src} -> {kind}) returned {rc}")
    os.replace(tmp, out)
    del log
    return {"seconds": time.perf_counter() - t0}


def run_child(python: str, *args) -> dict:
    """This file's `--child` entry `args` in a fresh process of `python` (its stderr shown only if it fails);
    its last stdout line is JSON."""
    res = subprocess.run([python, __file__, "--child", json.dumps(args)], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{res.stderr[-3000:]}\n{args[0]} ({python}) failed (exit {res.returncode}); its stderr's "
                         f"end is above")
    return json.loads(res.stdout.strip().splitlines()[-1])


def ensure_gguf(name: str, ckpt: Path, kind: str, sdist: Path | None, llama_python: str, threads: int = 2,
                progress=print, mtp: bool = False) -> Path:
    """The GGUF of `ckpt` in type `kind`, made (once) from its f32 GGUF, itself made (once) by the converter
    (`mtp`: with the checkpoint's first MTP module, keep_first_mtp_module)."""
    if kind not in GGUF_TYPES:
        raise SystemExit(f"--gguf {kind}: unknown type; expected one of {', '.join(GGUF_TYPES)}")
    f32 = gguf_path(name, "f32", mtp)
    if not f32.is_file():
        src = converter_dir(sdist)
        progress(f"{name}: converting {ckpt} to {f32}{' (with its first MTP module)' if mtp else ''} ...")
        run_child(sys.executable, "convert", str(src), str(ckpt), str(f32), "f32", mtp)
    out = gguf_path(name, kind, mtp)
    if not out.is_file():
        progress(f"{name}: quantizing to {out} ...")
        t = run_child(llama_python, "quantize", str(f32), str(out), kind, threads)
        progress(f"{name}: {GGUF_LABELS[kind]} made in {t['seconds']:.1f} s, {out.stat().st_size / 1e6:.1f} MB")
    return out


EXPORT_ROWS = 1024  # the cache rows a sequence of the 85m / 304m exports holds (real_size.py's); the demo's: its own


def export_path(size: str, nextn: int, quant: str, group_size: int, rows: int | None = None) -> Path:
    """The cached mtp-trt export of checkpoint `size` at `quant` (the demo: with `nextn` MTP depths; the others:
    nextn 1), holding `rows` cache rows a sequence where given (85m / 304m: else EXPORT_ROWS)."""
    tag = "" if quant == "none" else f"-{quant}-g{group_size}"
    base = f"export-{size}-n{nextn}" if size == "demo" else f"export-{size}-default"
    rows_tag = f"-s{rows}" if rows is not None and (size == "demo" or rows != EXPORT_ROWS) else ""
    return cache_dir() / f"{base}{tag}{rows_tag}-{revision()}"


def export_child(ckpt: str, out: str, nextn: int, max_seq_len: int | None, quant: str, group_size: int) -> dict:
    """(in a child process) one export -> its wall time and peak RSS."""
    from mtp_trt.exporters.export import export

    t0 = time.perf_counter()
    export(ckpt, out, nextn=nextn, max_seq_len=max_seq_len, quant_scheme=quant, group_size=group_size)
    return {"seconds": time.perf_counter() - t0, "peak_rss_mb": peak_rss_mb()}


def ensure_export(size: str, ckpt: Path, nextn: int, quant: str, group_size: int, progress=print,
                  rows: int | None = None) -> Path:
    """The mtp-trt export of `ckpt` (checkpoint `size`) at `quant`, made once (in a child of this Python);
    `rows`: the cache rows a sequence holds (default: the demo's own, EXPORT_ROWS for 85m / 304m)."""
    out = export_path(size, nextn, quant, group_size, rows)
    if not (out / "manifest.json").is_file():
        progress(f"{size}: exporting --quant {quant} to {out} ...")
        args = (nextn, rows) if size == "demo" else (1, rows or EXPORT_ROWS)
        r = run_child(sys.executable, "export", str(ckpt), str(out), *args, quant, group_size)
        progress(f"{size}: exported --quant {quant} in {r['seconds']:.0f} s, peak RSS {r['peak_rss_mb']:.0f} MB")
    return out


# --------------------------------------------------------------------------------------------------- decoding
def model_params(ll, settings: str):
    """llama.cpp's default model parameters with LLAMA_SETTINGS[settings] applied."""
    repack, mmap = LLAMA_SETTINGS[settings]
    params = ll.llama_model_default_params()
    fields = {name for name, _ in type(params)._fields_}
    if not repack:
        if "use_extra_bufts" not in fields:
            raise SystemExit(f"llama_cpp {getattr(ll, '__version__', '?')}: no use_extra_bufts model parameter "
                             f"(for {settings}); a newer llama-cpp-python has it")
        params.use_extra_bufts = False
    if not mmap:
        if "use_mmap" in fields:
            params.use_mmap = False
        else:
            params.load_mode = ll.LLAMA_LOAD_MODE_NONE
    return params


class LlamaEngine:
    """One GGUF model and one context, driven through llama.h (module docstring)."""

    def __init__(self, gguf: str | Path, n_ctx: int, threads: int, n_batch: int | None = None,
                 settings: str = "default"):
        ll = self.ll = import_llama()
        self._log = quiet(ll)  # kept: llama.cpp holds the pointer
        ll.llama_backend_init()
        self.model = ll.llama_model_load_from_file(str(gguf).encode(), model_params(ll, settings))
        if not self.model:
            raise SystemExit(f"{gguf}: llama.cpp cannot load this GGUF")
        cp = ll.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_batch or n_ctx
        cp.n_ubatch = min(cp.n_batch, max(cp.n_ubatch, 512))
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = ll.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise SystemExit(f"{gguf}: llama_init_from_model failed (n_ctx {n_ctx})")
        self.n_ctx, self.n_batch = n_ctx, cp.n_batch
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        self.batch = ll.llama_batch_init(self.n_batch, 0, 1)
        self.sampler = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        ll.llama_sampler_chain_add(self.sampler, ll.llama_sampler_init_greedy())
        self.first = 0.0  # seconds of the last generation's prompt and first token

    def _fill(self, tokens, start: int, all_logits: bool) -> None:
        """The batch: `tokens` at positions start.., sequence 0, logits of the last one (or of every one)."""
        b, n = self.batch, len(tokens)
        if n > self.n_batch:
            raise ValueError(f"{n} tokens in one batch; the context takes {self.n_batch}")
        for i, t in enumerate(tokens):
            b.token[i] = t
            b.pos[i] = start + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = all_logits or i == n - 1
        b.n_tokens = n

    def _decode(self) -> None:
        rc = self.ll.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def reset(self) -> None:
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)
        self.ll.llama_sampler_reset(self.sampler)

    def generate(self, ids: list[int], new_tokens: int) -> list[int]:
        """Greedy: `new_tokens` tokens after the prompt `ids` (no stop on end-of-generation tokens).  Sets
        self.first to the seconds the prompt and the first token took."""
        ll, ctx, smpl, b = self.ll, self.ctx, self.sampler, self.batch
        if len(ids) + new_tokens > self.n_ctx:
            raise ValueError(f"{len(ids)} + {new_tokens} tokens; the context holds {self.n_ctx}")
        t0 = time.perf_counter()
        self.reset()
        self._fill(ids, 0, False)
        self._decode()
        out = [ll.llama_sampler_sample(smpl, ctx, -1)]
        self.first = time.perf_counter() - t0
        pos = len(ids)
        b.n_tokens = 1
        b.n_seq_id[0] = 1
        b.seq_id[0][0] = 0
        b.logits[0] = True
        while len(out) < new_tokens:
            b.token[0] = out[-1]
            b.pos[0] = pos
            self._decode()
            out.append(ll.llama_sampler_sample(smpl, ctx, -1))
            pos += 1
        return out

    def piece(self, token: int) -> bytes:
        """The bytes llama.cpp's programs print for `token` (llama_token_to_piece, special tokens rendered)."""
        vocab = self.ll.llama_model_get_vocab(self.model)
        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = self.ll.llama_token_to_piece(vocab, token, buf, size, 0, True)
            if n >= 0:
                return buf.raw[:n]
            size = -n

    def logits(self, ids: list[int]):
        """Teacher-forced logits [len(ids), n_vocab] (float32 NumPy) of a window, from an empty memory."""
        import numpy as np

        self.reset()
        self._fill(ids, 0, True)
        self._decode()
        ptr = self.ll.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(ptr, shape=(len(ids), self.n_vocab)).copy()

    def close(self) -> None:
        ll = self.ll
        ll.llama_sampler_free(self.sampler)
        ll.llama_batch_free(self.batch)
        ll.llama_free(self.ctx)
        ll.llama_model_free(self.model)


def decode_child(gguf: str, ids: list[int], tokens: int, rounds: int, threads: int,
                 settings: str = "default") -> dict:
    """(in a child process, a Python with llama_cpp) one GGUF alone with model settings `settings`
    (LLAMA_SETTINGS), as benchmarks/v2_lite.py times an export: new tokens / seconds of a whole generation
    (prompt included), the median of `rounds` after a warm-up, the tokens, the process's peak RSS, and its peak
    RSS once every page of its mappings of the GGUF file has been read (bench_common.read_mapped)."""
    import statistics

    engine = LlamaEngine(gguf, n_ctx=len(ids) + tokens + 16, threads=threads, settings=settings)
    generated = engine.generate(ids, tokens)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        engine.generate(ids, tokens)
        times.append(time.perf_counter() - t0)
    peak = peak_rss_mb()
    read_mapped(gguf)
    return {"tokens_per_second": tokens / statistics.median(times), "peak_rss_mb": peak,
            "peak_rss_read_mb": peak_rss_mb(), "generated": generated}


def greedy_child(gguf: str, ids: list[int], tokens: int, threads: int) -> dict:
    """(in a child process, a Python with llama_cpp) plain greedy decoding (LlamaEngine.generate) of `tokens` new
    tokens after `ids`, and the bytes llama.cpp's programs print for the prompt and for each new token (hex)."""
    engine = LlamaEngine(gguf, n_ctx=len(ids) + tokens + 16, threads=threads)
    generated = engine.generate(ids, tokens)
    return {"generated": generated, "prompt_text": b"".join(engine.piece(t) for t in ids).hex(),
            "pieces": [engine.piece(t).hex() for t in generated]}


def logits_child(gguf: str, ids: list[int], threads: int, out: str) -> dict:
    """(in a child process, a Python with llama_cpp) teacher-forced logits of `ids`, saved as a .npy at `out`."""
    import numpy as np

    np.save(out, LlamaEngine(gguf, n_ctx=len(ids) + 16, threads=threads).logits(ids))
    return {"file": out}


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        name, *args = json.loads(sys.argv[2])
        jobs = {"convert": convert_child, "quantize": quantize_child, "export": export_child, "decode": decode_child,
                "logits": logits_child, "greedy": greedy_child}
        print(json.dumps(jobs[name](*args)))
        return
    raise SystemExit("a module of the benchmarks that set llama.cpp beside mtp-trt (benchmarks/beside_llama_cpp.py, "
                     "quant_quality.py, serve.py, v2_lite.py); run those")


if __name__ == "__main__":
    main()
