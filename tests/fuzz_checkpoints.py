"""A seeded, bounded fuzz of moerun's checkpoint readers.

Small checkpoints of every format are generated here (no download): Hugging Face safetensors
directories with config.json, tokenizer files and generation_config.json (fused and per-expert
tensors, GPT-OSS MXFP4 blocks, shards with an index) and GGUF files with a vocabulary (f32, q8_0,
mxfp4, the i-quants with a q5_0 and an iq4_nl tensor, the old per-expert layout). Each case is one
seed mutated once (bytes flipped, the file cut, a JSON or header value or a GGUF field set to an
awkward value, a GGUF key's type changed, ...),
chosen by `random.Random(f"{seed}-{index}")`, so a case is rebuilt from its seed and index alone.

Each case runs in a child forked from a worker that has imported and warmed moerun once, with a
timeout and an address-space limit (RLIMIT_AS, the worker's own size plus MEMORY_LIMIT): it runs
`moerun.load(path, dtype=float32).logits(...)` on a few tokens and `moerun inspect`'s command. The
outcome is the worst of the two:

- ok: it ran (non-finite logits included, where the weights themselves are not finite and small);
- clear: a `moerun.CheckpointError` whose message names a file of the case and has at most
  MAX_MESSAGE characters;
- vague: moerun's own error, but outside that hierarchy, not naming the file, or too long;
- raw: any other exception;
- hang: past the timeout;  oom: MemoryError, or an allocation refused under the limit;
- crash: the child died by a signal;
- nan: non-finite logits (or router logits, which moerun refuses with a RouterError) although
  every weight is finite and at most WEIGHT_BOUND in magnitude;
- written: a file beside the inputs created, changed or removed.

    python tests/fuzz_checkpoints.py --cases 3000 --seed 0 --workers 2 --out summary.json [--mix]
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import hashlib
import json
import os
import queue
import random
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent
OUTCOMES = ("ok", "clear", "vague", "raw", "hang", "oom", "crash", "nan", "written")
BAD = frozenset(OUTCOMES) - {"ok", "clear"}
MAX_MESSAGE = 500  # characters of an error message ("a few hundred")
WEIGHT_BOUND = 1e3  # weights larger than this may overflow fp32 honestly
MEMORY_LIMIT = 4 << 30  # bytes a case may map beyond the worker's own size
TIMEOUT_S = 20.0
TOKENS = 4
STREAM_GB = 0.01  # the expert cache of a streamed case: a few of the seeds' experts per layer
SINGLE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# ---------------------------------------------------------------------------------------------
# Seeds


def build_seeds(root: Path) -> dict[str, Path]:
    """seed name -> the path `moerun.load` is given (a directory, or a .gguf file alone in one)."""
    sys.path.insert(0, str(TESTS))
    from gguf_from_hf import GGUF_OVERRIDES, write_gguf
    from hf_models import make_model, save_gpt_oss_mxfp4, save_model
    from tiny_tokenizers import VARIANTS, add_gguf_vocab, save_hf_dir

    root.mkdir(parents=True, exist_ok=True)
    seeds: dict[str, Path] = {}

    def hf_tokenizer(directory: Path, variant: str) -> None:
        make, config = VARIANTS[variant]
        tok = make()
        eos = config["eos_token"]
        added = {str(tok.token_to_id(eos)): {"content": eos, "special": True}}
        save_hf_dir(
            tok,
            directory,
            generation_config={"eos_token_id": [tok.token_to_id(eos)], "bos_token_id": 1},
            added_tokens_decoder=added,
            chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
            **config,
        )

    path = root / "hf-olmoe"
    save_model(make_model("olmoe", num_hidden_layers=2), path, original_format=False)
    hf_tokenizer(path, "qwen2")
    seeds["hf-olmoe"] = path

    path = root / "hf-mixtral-per-expert"
    save_model(make_model("mixtral", num_hidden_layers=2), path, original_format=True)
    hf_tokenizer(path, "spm")
    seeds["hf-mixtral-per-expert"] = path

    path = root / "hf-gpt-oss-mxfp4"
    save_gpt_oss_mxfp4(make_model("gpt_oss", num_hidden_layers=2, intermediate_size=32), path)
    seeds["hf-gpt-oss-mxfp4"] = path

    path = root / "hf-qwen2-moe-sharded"
    make_model("qwen2_moe", num_hidden_layers=2).save_pretrained(path, max_shard_size="60KB")
    hf_tokenizer(path, "gpt2")
    seeds["hf-qwen2-moe-sharded"] = path

    def vocab(variant: str, kind: str, pre: str | None, **keys):
        tok = VARIANTS[variant][0]()
        return lambda writer: add_gguf_vocab(writer, tok, kind, pre, merges=kind == "gpt2", **keys)

    ggufs = {
        "gguf-qwen3-moe-q8_0": (
            "qwen3_moe",
            dict(moe_intermediate_size=32),
            dict(experts="q8_0", extra=vocab("qwen2", "gpt2", "qwen2", eos_token_id=2)),
        ),
        "gguf-mixtral-per-expert": (
            "mixtral",
            {},
            dict(per_expert=True, extra=vocab("spm", "llama", None, bos_token_id=1, eos_token_id=2)),
        ),
        "gguf-gpt-oss-mxfp4": ("gpt_oss", dict(intermediate_size=32), dict(experts="mxfp4")),
        # the i-quants (random valid blocks: moerun does not write them) and a 32-element fallback
        "gguf-qwen3-moe-iquants": (
            "qwen3_moe",
            dict(hidden_size=256, moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2),
            dict(experts="iq2_xxs", down="iq3_s", attention="q5_0", per_tensor={"output.weight": "iq4_nl"}),
        ),
    }
    for name, (model_type, sizes, options) in ggufs.items():
        (root / name).mkdir(exist_ok=True)
        model = make_model(model_type, num_hidden_layers=2, **GGUF_OVERRIDES[model_type], **sizes)
        write_gguf(model, root / name / "model.gguf", **options)
        seeds[name] = root / name / "model.gguf"
    return seeds


# ---------------------------------------------------------------------------------------------
# Mutations: each edits the files of a case directory (a copy of a seed) in place and says what it did.

HUGE_DIGITS, DEEP = "__huge_digits__", "__deep__"
VALUES = [
    0, -1, 1, 2, 3, 7, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63, 2**64, 10**30, 1_000_000_000,
    0.0, -0.5, 1e-30, 1e308, -1e308, float("nan"), float("inf"), "", "x", "silu", "yarn", None, True,
    False, [], {}, [1, 2], [[]], {"a": 1}, HUGE_DIGITS, DEEP,
]  # fmt: skip
WHOLE_JSON = [b"[]", b"{", b"null", b'"x"', b"\xff\xfe{}", b"", b"[" * 200_000 + b"]" * 200_000]


def _json_text(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    text = text.replace(json.dumps(HUGE_DIGITS), "9" * 5000)
    return text.replace(json.dumps(DEEP), "[" * 200_000 + "]" * 200_000)


def _paths(obj, prefix=()):
    """Every (path, value) inside a JSON value, the root first."""
    yield prefix, obj
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj[:50]):
            yield from _paths(value, (*prefix, i))


def _edit_json(rng: random.Random, obj):
    """A copy of `obj` with one value replaced or one key deleted; and what was done."""
    paths = [p for p, _ in _paths(obj) if p]
    if not paths:
        return rng.choice(VALUES), "replaced the root"
    # keys near the top matter most (config fields, a tensor's entry), so pick by depth first
    depth = rng.choice(sorted({len(p) for p in paths}))
    path = rng.choice([p for p in paths if len(p) == depth])
    copy = json.loads(json.dumps(obj))
    parent = copy
    for key in path[:-1]:
        parent = parent[key]
    if isinstance(parent, dict) and rng.random() < 0.2:
        del parent[path[-1]]
        return copy, f"deleted {list(path)}"
    value = rng.choice(VALUES)
    parent[path[-1]] = value
    return copy, f"set {list(path)} to {value!r:.40}"


def _safetensors_parts(data: bytes) -> tuple[dict, bytes] | None:
    if len(data) < 8:
        return None
    (n,) = struct.unpack("<Q", data[:8])
    try:
        return json.loads(data[8 : 8 + n]), data[8 + n :]
    except ValueError:
        return None


def _write_safetensors(path: Path, header_text: str, rest: bytes) -> None:
    raw = header_text.encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + rest)


def _model_files(case: Path) -> list[Path]:
    return sorted(p for p in case.iterdir() if p.suffix in (".safetensors", ".gguf"))


def flip_bytes(rng: random.Random, case: Path) -> str:
    files = sorted(case.iterdir())
    path = rng.choice(_model_files(case) * 3 + files)
    data = bytearray(path.read_bytes())
    if not data:
        return f"{path.name}: empty, left as is"
    head = min(len(data), _header_size(path, data))
    n = rng.choice([1, 1, 2, 4, 16])
    for _ in range(n):
        i = rng.randrange(head) if rng.random() < 0.7 else rng.randrange(len(data))
        data[i] ^= rng.randrange(1, 256)
    path.write_bytes(bytes(data))
    return f"{path.name}: {n} bytes flipped"


def _header_size(path: Path, data: bytes) -> int:
    if path.suffix == ".safetensors" and len(data) >= 8:
        return 8 + struct.unpack("<Q", data[:8])[0]
    if path.suffix == ".gguf":
        import gguf

        try:
            return min(t.data_offset for t in gguf.GGUFReader(path).tensors)
        except Exception:
            return len(data)
    return len(data)


def truncate(rng: random.Random, case: Path) -> str:
    path = rng.choice(_model_files(case) * 2 + sorted(case.iterdir()))
    data = path.read_bytes()
    head = min(len(data), _header_size(path, data))
    cut = rng.randrange(head + 1) if rng.random() < 0.6 else rng.randrange(len(data) + 1)
    path.write_bytes(data[:cut])
    return f"{path.name}: cut to {cut} of {len(data)} bytes"


def edit_json_file(rng: random.Random, case: Path) -> str:
    files = sorted(p for p in case.iterdir() if p.suffix == ".json")
    if not files:
        return flip_bytes(rng, case)
    path = rng.choice(files + [f for f in files if f.name == "config.json"] * 3)
    if rng.random() < 0.12:
        text = rng.choice(WHOLE_JSON)
        path.write_bytes(text)
        return f"{path.name}: replaced by {text[:12]!r}"
    edited, what = _edit_json(rng, json.loads(path.read_text(encoding="utf-8")))
    path.write_text(_json_text(edited), encoding="utf-8")
    return f"{path.name}: {what}"


def edit_safetensors_header(rng: random.Random, case: Path) -> str:
    files = [p for p in _model_files(case) if p.suffix == ".safetensors"]
    if not files:
        return flip_bytes(rng, case)
    path = rng.choice(files)
    parts = _safetensors_parts(path.read_bytes())
    if parts is None:
        return flip_bytes(rng, case)
    header, rest = parts
    names = [n for n in header if n != "__metadata__"]
    kind = rng.choice(["value", "value", "duplicate", "overlap", "dtype", "shape", "nest"])
    name = rng.choice(names)
    entry = header[name]
    if kind == "duplicate":
        other = rng.choice(names)
        text = json.dumps(header)
        text = text[:-1] + f", {json.dumps(other)}: {json.dumps(header[name])}}}"
        _write_safetensors(path, text, rest)
        return f"{path.name}: {other!r} named twice"
    if kind == "overlap":
        same = [n for n in names if _span(header[n]) == _span(entry) and n != name]
        other = rng.choice(same or names)
        begin, end = header[other]["data_offsets"]
        size = _span(entry)
        start = begin if same else min(begin + rng.randrange(max(1, end - begin)), len(rest) - size)
        entry["data_offsets"] = [max(start, 0), max(start, 0) + size]
        what = f"{name!r} moved over {other!r}"
    elif kind == "dtype":
        swaps = {"F32": ["I32", "U32"], "BF16": ["F16", "I16"], "F16": ["BF16", "I16"], "U8": ["I8", "BOOL"]}
        entry["dtype"] = rng.choice(swaps.get(entry["dtype"], ["I32"]))
        what = f"{name!r} dtype now {entry['dtype']}"
    elif kind == "shape":
        shape = entry["shape"]
        entry["shape"] = shape[::-1] if len(shape) > 1 else [*shape, 1]
        what = f"{name!r} shape now {entry['shape']}"
    elif kind == "nest":
        text = json.dumps(header)
        text = text[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}"
        _write_safetensors(path, text, rest)
        return f"{path.name}: a deeply nested value"
    else:
        edited, what = _edit_json(rng, header)
        _write_safetensors(path, _json_text(edited), rest)
        return f"{path.name} header: {what}"
    _write_safetensors(path, json.dumps(header), rest)
    return f"{path.name}: {what}"


def _span(entry) -> int:
    try:
        return entry["data_offsets"][1] - entry["data_offsets"][0]
    except (TypeError, KeyError, IndexError):
        return -1


def edit_gguf_field(rng: random.Random, case: Path) -> str:
    """One number in a GGUF file's header set in place: a metadata value, a string or array length,
    a value type, or a tensor's dims, type or offset."""
    import gguf
    import numpy as np

    files = [p for p in _model_files(case) if p.suffix == ".gguf"]
    if not files:
        return edit_safetensors_header(rng, case)
    path = files[0]
    reader = gguf.GGUFReader(path, "r+")
    fields = [f for f in reader.fields.values() if not f.name.startswith("GGUF.")]
    tensor = rng.random() < 0.3
    if tensor:
        field = rng.choice(reader.tensors).field
        # parts: name length, name, n_dims, dims, type, offset
        index = rng.choice([0, 2, 3, 3, 4, 5, 5, 5])
    else:
        field = rng.choice(fields)
        # parts: key length, key, value type, then the value's parts (a length before a string,
        # the element type and count before an array)
        index = rng.choice([0, 2] + list(range(3, len(field.parts))) * 3)
    part = field.parts[index]
    if part.dtype.kind in "ui":
        info = np.iinfo(part.dtype)
        old = int(part.flat[0])
        choices = [0, 1, old + 1, old - 1, old * 2, old + 32, info.max, info.max // 2, 2**32 - 1]
        choices += [other.data_offset - reader.data_offset for other in reader.tensors]
        value = rng.choice([c for c in choices if info.min <= c <= info.max])
    elif part.dtype.kind == "f":
        value = rng.choice([0.0, -1.0, 1e30, -1e-30, float("nan"), float("inf"), 1e-9, 65504.0])
    else:
        reader.data.flush()
        return flip_bytes(rng, case)
    where = field.name if not tensor else f"tensor {field.name}"
    at = rng.randrange(part.size) if part.size else 0
    if part.size:
        part.flat[at] = value
    reader.data.flush()
    del reader
    return f"{path.name}: {where} part {index}[{at}] set to {value!r}"


def retype_gguf_key(rng: random.Random, case: Path) -> str:
    """The GGUF file rewritten with one metadata key deleted, or given a value of another type."""
    import gguf

    files = [p for p in _model_files(case) if p.suffix == ".gguf"]
    if not files:
        return edit_json_file(rng, case)
    path = files[0]
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    kv = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        kv[name] = gguf.GGUFValue(field.contents(), vtype, sub)
    key = rng.choice(sorted(kv))
    V = gguf.GGUFValueType
    options = [
        None,
        gguf.GGUFValue(rng.choice([0, 1, 2**32 - 1, 7]), V.UINT32),
        gguf.GGUFValue(rng.choice([-1, 2**62, -(2**63)]), V.INT64),
        gguf.GGUFValue(rng.choice([0.0, -1.0, float("nan"), 1e30]), V.FLOAT32),
        gguf.GGUFValue(rng.choice(["", "x", "llama", "\udcff"[:0] + "ü"]), V.STRING),
        gguf.GGUFValue(True, V.BOOL),
        gguf.GGUFValue([1, 2, 3], V.ARRAY, V.INT32),
        gguf.GGUFValue(["a", "b c", ""], V.ARRAY, V.STRING),
        gguf.GGUFValue([], V.ARRAY, V.UINT32),
    ]
    value = rng.choice(options)
    if value is None:
        del kv[key]
    else:
        kv[key] = value
    writer = gguf.GGUFWriter(path.with_suffix(".tmp"), arch, endianess=gguf.GGUFEndian.LITTLE)
    writer.kv_data[0].update(kv)
    if "general.architecture" not in kv:
        del writer.kv_data[0]["general.architecture"]
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data)
    writer.close()
    del reader
    path.with_suffix(".tmp").replace(path)
    what = "deleted" if value is None else f"set to {value.type.name} {value.value!r:.30}"
    return f"{path.name}: metadata {key} {what}"


MUTATORS = {
    "flip_bytes": (flip_bytes, 3),
    "truncate": (truncate, 2),
    "edit_json_file": (edit_json_file, 4),
    "edit_safetensors_header": (edit_safetensors_header, 3),
    "edit_gguf_field": (edit_gguf_field, 4),
    "retype_gguf_key": (retype_gguf_key, 3),
}
_HF_ONLY = {"edit_json_file", "edit_safetensors_header"}
_GGUF_ONLY = {"edit_gguf_field", "retype_gguf_key"}


def make_case(seeds: dict[str, Path], seed: int, index: int, root: Path, mix: bool = False) -> dict:
    """Case `index` of run `seed`: a mutated copy of one seed under root/<index>. `mix`: a third of
    the cases get two mutations, and each is run in bf16 or fp32, resident or streamed (its experts
    through a small expert cache), as chosen; without it, one mutation, fp32, resident."""
    rng = random.Random(f"{seed}-{index}")
    name = rng.choice(sorted(seeds))
    source = seeds[name]
    gguf_seed = source.suffix == ".gguf"
    allowed = [m for m in MUTATORS if m not in (_HF_ONLY if gguf_seed else _GGUF_ONLY)]
    case = root / f"{index:05d}"
    shutil.copytree(source.parent if gguf_seed else source, case)
    done = []
    for _ in range(rng.choice([1, 1, 2]) if mix else 1):
        mutator = rng.choices(allowed, [MUTATORS[m][1] for m in allowed])[0]
        try:
            done.append(MUTATORS[mutator][0](rng, case))
        except Exception as err:  # a mutation the seed does not allow: the case is the seed as is
            done.append(f"{mutator} failed ({type(err).__name__}: {err!s:.60}); left as is")
    options = {"dtype": rng.choice(["float32", "bfloat16"]), "streamed": rng.random() < 0.3} if mix else {}
    path = case / source.name if gguf_seed else case
    what = "; ".join(done)
    return {
        "index": index,
        "seed": name,
        "mutation": what,
        "path": str(path),
        "dir": str(case),
        "options": options,
    }


def snapshot(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha1(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


# ---------------------------------------------------------------------------------------------
# One case, in the child


class NaNFromFiniteWeights(Exception):
    pass


def _outcome_of(error: BaseException, names: list[str]) -> tuple[str, str]:
    import moerun

    message = str(error)
    hierarchy = getattr(moerun, "CheckpointError", None) or __import__("moerun.loader").loader.CheckpointError
    if isinstance(error, MemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in message
    ):
        return "oom", message
    if isinstance(error, NaNFromFiniteWeights):
        return "nan", message
    if not type(error).__module__.startswith("moerun"):
        return "raw", message
    named = any(n in message for n in names)
    if isinstance(error, hierarchy) and named and len(message) <= MAX_MESSAGE:
        return "clear", message
    return "vague", message


def _where(error: BaseException) -> str:
    """The deepest frame inside moerun (or the last one) of the error's traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if "/moerun/" in f.filename] or frames
    if not ours:
        return "?"
    f = ours[-1]
    return f"{f.filename.rsplit('/moerun/', 1)[-1]}:{f.lineno} {f.name}"


def _weights_finite(path: Path) -> bool:
    """Whether every weight of the checkpoint, as the reference readers read it, is finite and at
    most WEIGHT_BOUND (MXFP4 scales at most 2**10); False where they cannot read it."""
    import numpy as np

    try:
        if path.suffix == ".gguf":
            import gguf

            for t in gguf.GGUFReader(path).tensors:
                values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
                if not (np.isfinite(values).all() and np.abs(values).max(initial=0) <= WEIGHT_BOUND):
                    return False
            return True
        from safetensors.numpy import load_file

        for file in path.glob("*.safetensors"):
            for name, values in load_file(file).items():
                if name.endswith("_scales"):
                    if values.max(initial=0) > 127 + 10:
                        return False
                elif values.dtype.kind == "f" or values.dtype.itemsize == 2:
                    v = values.astype(np.float64) if values.dtype.kind == "f" else None
                    if v is None or not (np.isfinite(v).all() and np.abs(v).max(initial=0) <= WEIGHT_BOUND):
                        return False
        return True
    except Exception:
        return False


def _load_and_logits(path: Path, dtype: str = "float32", streamed: bool = False) -> None:
    import torch

    import moerun

    model = moerun.load(path, dtype=getattr(torch, dtype), expert_cache_gb=STREAM_GB if streamed else None)
    ids = torch.arange(min(TOKENS, model.config.max_positions))[None] % model.config.vocab_size
    try:
        logits = model.logits(ids)
    except moerun.RouterError as err:  # NaN or inf router logits: the weights' doing, or moerun's
        if _weights_finite(path):
            raise NaNFromFiniteWeights(f"{err} ({path}: every weight is finite)") from None
        return
    if not torch.isfinite(logits).all() and _weights_finite(path):
        raise NaNFromFiniteWeights(f"non-finite logits from finite weights ({path})")


def _inspect(path: Path) -> None:
    from moerun.cli import inspect

    inspect.run(argparse.Namespace(path=str(path), json=False))


def run_case(path: str, **options) -> dict:
    """Both runs of one case, each classified; `outcome` is the worse. `options` go to the load
    (`dtype`, `streamed`)."""
    import warnings

    path_ = Path(path)
    directory = path_ if path_.is_dir() else path_.parent
    names = [str(directory)] + [p.name for p in directory.iterdir()]
    result = {}
    load = functools.partial(_load_and_logits, **options)
    for step, fn in (("load", load), ("inspect", _inspect)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                fn(path_)
                outcome, message, where = "ok", "", ""
            except BaseException as error:  # noqa: BLE001 - classifying is the point
                outcome, message = _outcome_of(error, names)
                where = f"{type(error).__name__} at {_where(error)}"
        result[step] = {
            "outcome": outcome,
            "message": message[:300],
            "length": len(message),
            "where": where,
            "warnings": [str(w.message)[:200] for w in caught],
        }
    result["outcome"] = max((result[s]["outcome"] for s in ("load", "inspect")), key=OUTCOMES.index)
    return result


# ---------------------------------------------------------------------------------------------
# The worker: imports moerun once, warms it on the seeds, then forks one child per case.


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def serve(warm: list[str]) -> None:
    """Read one JSON request per line on stdin ({"path", "timeout"}), answer one JSON line each."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever moerun prints goes to stderr, not into the answers
    import torch

    torch.set_num_threads(1)
    for path in warm:  # the first load of each kind builds and imports what later ones reuse
        run_case(path)
        run_case(path, dtype="bfloat16", streamed=True)
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        case = functools.partial(run_case, **request["options"])
        out.write(json.dumps(_fork_case(request["path"], request["timeout"], case)) + "\n")


def _fork_case(path: str, timeout: float, case=run_case) -> dict:
    """`case(path)` in a forked child under the time and memory limits; its answer, or what
    became of the child."""
    read, write = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: limits, quiet output, the case, the answer, exit
        try:
            os.close(read)
            # torch rebuilds its thread pool in a forked child on first use, without a lock: a
            # streamed load's reader thread and this one racing to it get "Invalid thread pool!".
            # Rebuilt here, while this is the child's only thread, nothing races.
            if "torch" in sys.modules:
                sys.modules["torch"].set_num_threads(1)
            limit = _vm_size() + MEMORY_LIMIT
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            faulthandler.disable()  # it writes to the stderr it was given, not to fd 2
            answer = json.dumps(case(path)).encode()
            os.write(write, answer)
        finally:
            os._exit(0)
    os.close(write)
    chunks, deadline = [], start + timeout
    while True:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([read], [], [], max(left, 0))
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read)
            return {"outcome": "hang", "seconds": timeout}
        chunk = os.read(read, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    seconds = round(time.monotonic() - start, 3)
    if not chunks:
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        return {"outcome": "crash", "signal": sig, "seconds": seconds}
    return {**json.loads(b"".join(chunks)), "seconds": seconds}


class Worker:
    def __init__(self, warm: list[str]):
        # the moerun beside these tests, whatever is installed
        env = {**os.environ, **SINGLE_THREAD, "PYTHONPATH": f"{TESTS.parent}{os.pathsep}{TESTS}"}
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve", *warm],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError("the fuzz worker did not start")

    def run(self, path: str, timeout: float, options: dict | None = None) -> dict:
        request = {"path": path, "timeout": timeout, "options": options or {}}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def fuzz(
    seeds: dict[str, Path],
    cases: int,
    seed: int = 0,
    workers: int = 2,
    timeout: float = TIMEOUT_S,
    start: int = 0,
    keep: Path | None = None,
    mix: bool = False,
) -> list[dict]:
    """Run cases start .. start+cases-1 of run `seed` (`mix`: see make_case); one record per case
    (its mutation and outcome). Cases with a bad outcome are kept under `keep`, when given."""
    root = Path(tempfile.mkdtemp(prefix="moerun-fuzz-"))
    todo: queue.Queue = queue.Queue()
    for index in range(start, start + cases):
        todo.put(index)
    records: list[dict] = []
    lock = threading.Lock()
    warm = [str(p) for p in seeds.values()]

    def drain(worker: Worker) -> None:
        while True:
            try:
                index = todo.get_nowait()
            except queue.Empty:
                return
            with lock:
                case = make_case(seeds, seed, index, root, mix)
            before = snapshot(Path(case["dir"]))
            result = worker.run(case["path"], timeout, case["options"])
            if snapshot(Path(case["dir"])) != before:
                result["outcome"] = "written"
            record = {**case, **result}
            if keep is not None and record["outcome"] in BAD:
                shutil.copytree(case["dir"], keep / Path(case["dir"]).name, dirs_exist_ok=True)
            shutil.rmtree(case["dir"], ignore_errors=True)
            with lock:
                records.append(record)

    pool = [Worker(warm) for _ in range(workers)]
    try:
        threads = [threading.Thread(target=drain, args=(w,)) for w in pool]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for w in pool:
            w.close()
        shutil.rmtree(root, ignore_errors=True)
    return sorted(records, key=lambda r: r["index"])


def summarise(records: list[dict]) -> dict:
    counts = Counter(r["outcome"] for r in records)
    places = Counter()
    for r in records:
        if r["outcome"] in BAD:
            for step in ("load", "inspect"):
                if step in r and r[step]["outcome"] in BAD:
                    places[f"{r[step]['outcome']}: {r[step]['where']}"] += 1
            if "load" not in r:
                places[r["outcome"]] += 1
    return {
        "cases": len(records),
        "counts": {o: counts.get(o, 0) for o in OUTCOMES},
        "places": dict(places.most_common()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0, help="the first case's index")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S)
    parser.add_argument("--seeds-dir", type=Path, default=None, help="reuse or build the seeds here")
    parser.add_argument("--keep", type=Path, default=None, help="copy cases with a bad outcome here")
    parser.add_argument("--out", type=Path, default=None, help="write every record and the summary (JSON)")
    parser.add_argument(
        "--mix", action="store_true", help="two mutations in some cases; bf16 and streamed loads too"
    )
    parser.add_argument("--serve", nargs="*", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve(args.serve)
        return 0
    seeds_dir = args.seeds_dir or Path(tempfile.mkdtemp(prefix="moerun-fuzz-seeds-"))
    seeds = build_seeds(seeds_dir)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    records = fuzz(seeds, args.cases, args.seed, args.workers, args.timeout, args.start, args.keep, args.mix)
    summary = summarise(records)
    summary["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
