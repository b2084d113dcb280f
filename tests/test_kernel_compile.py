"""Every Triton kernel moerun launches compiles for an H100/H200 (sm_90), with no GPU present.

The other kernel tests run the kernels in triton's interpreter, which executes them as Python and
so accepts what the compiler rejects: a kernel reading a plain module global (compiled Triton reads
only `tl.constexpr` ones), a type only the compiler checks. Compiling needs no GPU: triton lowers a
kernel to PTX and assembles it with the ptxas its wheel bundles; where that toolchain cannot compile
for CUDA the module is skipped. Under TRITON_INTERPRET (conftest sets it without CUDA) `triton.jit`
makes interpreted functions, triton's own included, which cannot be compiled, so the compiling runs
in a worker process started without it: this file run as a script, one JSON request a line.

Each kernel's argument list comes from its own signature: a case gives only the element types of
the pointers that vary (activations, weights), the constexpr values (from the launchers' own helpers
where they exist) and the block sizes of `launch_configs/default.json` or the module's defaults. By
default each weight format, activation and activation dtype is compiled at least once (under a
minute on two cores); `pytest -m slow` compiles the full grid.
"""

import importlib
import inspect
import json
import os
import pkgutil
import re
import select
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime import KernelInterface  # noqa: E402

import moerun  # noqa: E402
from moerun.activations import GLU, GptOssSwiGLU  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # H100, H200
ACTS = {
    "silu": GLU("silu"),
    "gelu": GLU("gelu"),
    "gelu_tanh": GLU("gelu_tanh"),
    "gpt_oss": GptOssSwiGLU(alpha=1.702, limit=7.0),
}
INTERMEDIATE = 1536  # the GLU kinds' UP_OFFSET constexpr
# names as in moerun.kernels.weights.FORMAT_NAMES (checked in test_cases_cover_every_format)
FORMATS = [
    "f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q6_k", "mxfp4", "mxfp4_gpt_oss", "q5_k", "q2_k", "q3_k",
    "q4_1", "q5_0", "q5_1", "iq4_nl", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m",
    "iq4_xs", "tq1_0", "tq2_0",
]  # fmt: skip
Q8_1_FORMATS = [
    "q8_0",
    "q4_0",
    "mxfp4",
    "q2_k",
    "q3_k",
    "q4_k",
    "q5_k",
    "q6_k",
    "q4_1",
    "q5_0",
    "q5_1",
    "iq4_nl",
    "iq4_xs",
]  # as decode_q8_1.Q8_1_GROUP_BYTES
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# Element type of each pointer argument, by name, where it is the same in every kernel and case.
POINTERS = {
    "sorted_rows_ptr": "i32", "block_experts_ptr": "i32", "inverse_ptr": "i32", "slots_ptr": "i32",
    "experts_ptr": "i32", "weights_ptr": "fp32", "row_weights_ptr": "fp32", "rows_ptr": "fp32",
    "out_ptr": "fp32", "y_ptr": "fp32", "h_ptr": "fp32", "qs_ptr": "i8", "d_ptr": "fp32", "s_ptr": "fp32",
    "d8_ptr": "fp32", "s8_ptr": "fp32", "table_ptr": "i8",
}  # fmt: skip
# Scalar arguments that are not int32 (the launchers pass python ints; expert strides can pass 2^31).
SCALARS = {"alpha": "fp32", "limit": "fp32", "w_expert_stride": "i64", "expert_stride": "i64"}


def _weight_type(fmt: str) -> str:
    return {"f32": "fp32", "f16": "fp16", "bf16": "bf16"}.get(fmt, "u8")


# ---------------------------------------------------------------- compiling


@triton.jit
def _probe_kernel(x_ptr, n, BLOCK: tl.constexpr):
    """A kernel that cannot be wrong: if it does not compile, the toolchain cannot."""
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


def _compile(kernel, pointers: dict, constexprs: dict, config: dict) -> dict:
    """Compile `kernel` with its arguments typed as POINTERS / SCALARS say, `pointers` overriding,
    and `constexprs`; `config`'s num_warps / num_stages as launch options. Returns the asm dict."""
    name = kernel.__name__
    wanted = {p.name for p in kernel.params if p.is_constexpr}
    assert set(constexprs) == wanted, (
        f"{name} takes constexprs {sorted(wanted)}; the case gives {sorted(constexprs)}"
    )
    signature = {}
    for p in kernel.params:
        if p.is_constexpr:
            signature[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            element = pointers.get(p.name, POINTERS.get(p.name))
            assert element, f"no element type for {name}'s pointer {p.name}: add it to POINTERS or the case"
            signature[p.name] = "*" + element
        else:
            signature[p.name] = SCALARS.get(p.name, "i32")
    assert set(pointers) <= set(signature), (
        f"{name} has no arguments {sorted(set(pointers) - set(signature))}"
    )
    options = {key: config[key] for key in ("num_warps", "num_stages") if key in config}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=TARGET, options=options)
    assert compiled.asm["cubin"], f"{name}: no cubin"
    return compiled.asm


# ---------------------------------------------------------------- cases
# A builder takes the modules and a case's parameters and returns (kernel, pointers, constexprs, config).

BUILDERS = {}


def builds(path: str):
    def register(fn):
        BUILDERS[path] = fn
        return fn

    return register


def _act_constexprs(m, act: str) -> dict:
    args = m.activation.activation_args(ACTS[act], INTERMEDIATE)
    return {k: v for k, v in args.items() if k.isupper()}  # ACT, ROW_STEP, UP_OFFSET; alpha, limit: scalars


def _dot(m, dtype: str) -> int:
    return m.grouped_gemm._dot_mode(torch.empty(0, dtype=DTYPES[dtype], device="meta"))  # as on a GPU


@builds("grouped_gemm._gate_up_kernel")
def _prefill_gate_up(m, fmt, act, dtype, bias=True):
    cfg = m.configs.launch_config("prefill_gate_up", fmt, 0, 0, None)
    constexprs = dict(
        TOP_K=4, HAS_BIAS=bias, FMT=m.weights.FORMAT_CODES[fmt], **_act_constexprs(m, act),
        DOT=_dot(m, dtype), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
    )  # fmt: skip
    pointers = dict(x_ptr=dtype, w_ptr=_weight_type(fmt), bias_ptr=dtype, a_ptr=dtype)
    return m.grouped_gemm._gate_up_kernel, pointers, constexprs, cfg


@builds("grouped_gemm._down_kernel")
def _prefill_down(m, fmt, dtype, bias=True):
    cfg = m.configs.launch_config("prefill_down", fmt, 0, 0, None)
    block_m = m.configs.launch_config("prefill_gate_up", "", 0, 0, None)[
        "BLOCK_M"
    ]  # the plan's, as the backend
    constexprs = dict(
        HAS_BIAS=bias, FMT=m.weights.FORMAT_CODES[fmt], DOT=_dot(m, dtype),
        BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
    )  # fmt: skip
    pointers = dict(a_ptr=dtype, w_ptr=_weight_type(fmt), bias_ptr=dtype)
    return m.grouped_gemm._down_kernel, pointers, constexprs, cfg


@builds("grouped_gemm._combine_kernel")
def _prefill_combine(m):
    cfg = m.grouped_gemm.DEFAULT_CONFIG
    constexprs = dict(TOP_K=4, BLOCK_T=cfg["BLOCK_T"], BLOCK_H=cfg["BLOCK_H"])
    return m.grouped_gemm._combine_kernel, {}, constexprs, cfg


@builds("decode._experts_gemv_kernel")
def _decode_gemv(m, fmt, role, dtype, bias=True):
    """role "gate_up": x of the model's dtype, bias not scaled; "down": x fp32 (the activation), scaled."""
    cfg = m.configs.launch_config(f"decode_{role}", fmt, 0, 0, None)
    constexprs = dict(
        FMT=m.weights.FORMAT_CODES[fmt], HAS_BIAS=bias, SCALE_BIAS=role == "down",
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
    )  # fmt: skip
    pointers = dict(x_ptr=dtype if role == "gate_up" else "fp32", w_ptr=_weight_type(fmt), bias_ptr=dtype)
    return m.decode._experts_gemv_kernel, pointers, constexprs, cfg


@builds("decode._activate_kernel")
def _decode_activate(m, act, q8_1):
    cfg = m.decode.ACTIVATION_CONFIG
    constexprs = dict(**_act_constexprs(m, act), Q8_1=q8_1, GROUPS=cfg["BLOCK_I"] // m.decode_q8_1.QK)
    return m.decode._activate_kernel, {"a_ptr": "fp32"}, constexprs, cfg


@builds("decode._sum_rows_kernel")
def _decode_sum(m):
    cfg = m.decode.SUM_CONFIG
    return m.decode._sum_rows_kernel, {}, {"BLOCK_H": cfg["BLOCK_H"]}, cfg


@builds("decode_q8_1._quantize_q8_1_kernel")
def _quantize_q8_1(m, dtype):
    cfg = m.decode_q8_1.QUANTIZE_CONFIG
    constexprs = {"GROUPS": cfg["BLOCK_I"] // m.decode_q8_1.QK}
    return m.decode_q8_1._quantize_q8_1_kernel, {"x_ptr": dtype}, constexprs, cfg


@builds("decode_q8_1.experts_gemv_q8_1_kernel")
def _decode_gemv_q8_1(m, fmt, role, dtype, bias=True):
    q = m.decode_q8_1
    cfg = q.GEMV_Q8_1_CONFIG
    code = m.weights.FORMAT_CODES[fmt]
    constexprs = dict(
        FMT=code, GROUP_BYTES=q.Q8_1_GROUP_BYTES[code], HAS_BIAS=bias, SCALE_BIAS=role == "down",
        BLOCK_N=cfg["BLOCK_N"],
    )  # fmt: skip
    return q.experts_gemv_q8_1_kernel, {"w_ptr": "u8", "bias_ptr": dtype}, constexprs, cfg


def _case(path: str, **params):
    return pytest.param(
        path, params, id="-".join([path.split(".")[1].strip("_"), *map(str, params.values())])
    )


_ROTATE = ["bf16", "fp32"]
FAST = [
    # every format through load_weight_tile once, in turn as gate_up and down
    *[
        _case(
            "decode._experts_gemv_kernel", fmt=f, role=("gate_up", "down")[i % 2], dtype=_ROTATE[i // 2 % 2]
        )
        for i, f in enumerate(FORMATS)
    ],
    # the prefill GEMMs in both DOT modes (bf16: the native dot; fp32: IEEE, the slowest to compile),
    # with GPT-OSS's interleaved rows and a GLU's halves
    _case("grouped_gemm._gate_up_kernel", fmt="mxfp4_gpt_oss", act="gpt_oss", dtype="bf16"),
    _case("grouped_gemm._gate_up_kernel", fmt="f16", act="silu", dtype="fp32"),
    _case("grouped_gemm._down_kernel", fmt="q6_k", dtype="bf16"),
    _case("grouped_gemm._down_kernel", fmt="f16", dtype="fp32"),
    _case("grouped_gemm._combine_kernel"),
    # every activation (moerun.kernels.activation.activate, which the prefill gate_up shares)
    *[_case("decode._activate_kernel", act=a, q8_1=q) for a in ACTS for q in (False, True)],
    _case("decode._sum_rows_kernel"),
    *[_case("decode_q8_1._quantize_q8_1_kernel", dtype=d) for d in DTYPES],
    *[
        _case(
            "decode_q8_1.experts_gemv_q8_1_kernel",
            fmt=f,
            role=("gate_up", "down")[i % 2],
            dtype=_ROTATE[i % 2],
        )
        for i, f in enumerate(Q8_1_FORMATS)
    ],
]
FULL = [
    *[
        _case("grouped_gemm._gate_up_kernel", fmt=f, act=a, dtype=d, bias=b)
        for f in FORMATS for a in ACTS for d in DTYPES for b in (True, False) if b or a == "silu"
    ],
    *[
        _case("grouped_gemm._down_kernel", fmt=f, dtype=d, bias=b)
        for f in FORMATS for d in DTYPES for b in (True, False)
    ],
    *[
        _case("decode._experts_gemv_kernel", fmt=f, role=r, dtype=d, bias=b)
        for f in FORMATS for r in ("gate_up", "down") for d in DTYPES for b in (True, False)
    ],
    *[
        _case("decode_q8_1.experts_gemv_q8_1_kernel", fmt=f, role=r, dtype=d, bias=b)
        for f in Q8_1_FORMATS for r in ("gate_up", "down") for d in DTYPES for b in (True, False)
    ],
]  # fmt: skip


def _key(case) -> tuple:
    path, params = case.values
    bound = inspect.signature(BUILDERS[path]).bind(None, **params)
    bound.apply_defaults()
    return path, tuple(bound.arguments.items())


SLOW = [p for p in FULL if _key(p) not in {_key(f) for f in FAST}]


# ---------------------------------------------------------------- the worker and the tests

REPLY_TIMEOUT_S = 600  # one compile takes seconds; a hung compiler fails its test instead of the run


def _serve() -> None:
    """The worker: a request {"path", "params"} (or {"probe": true}) a line on stdin, a reply
    {"ok", "seconds"} or {"ok": false, "error": traceback} a line on stdout."""
    replies, sys.stdout = sys.stdout, sys.stderr  # what the compiler prints stays out of the replies
    modules = _kernel_modules()
    for line in sys.stdin:
        request = json.loads(line)
        start = time.perf_counter()
        try:
            if request.get("probe"):
                _compile(_probe_kernel, {"x_ptr": "fp32"}, {"BLOCK": 32}, {})
            else:
                _compile(*BUILDERS[request["path"]](modules, **request["params"]))
            reply = {"ok": True, "seconds": time.perf_counter() - start}
        except Exception:
            reply = {"ok": False, "error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


class _Worker:
    def __init__(self, cache_dir: Path):
        # as a GPU run sees it: not interpreted, no leave to read plain module globals
        unset = ("TRITON_INTERPRET", "TRITON_ALLOW_NON_CONSTEXPR_GLOBALS")
        env = {k: v for k, v in os.environ.items() if k not in unset}
        env["TRITON_CACHE_DIR"] = str(cache_dir)  # compile for real; leave no sm_90 binaries behind
        root = str(Path(moerun.__file__).parents[1])  # the moerun this process tests
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (open while the worker runs)
        self.proc = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
            env=env, text=True,
        )  # fmt: skip

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.stderr.seek(0)
            log = self.stderr.read()[-4000:]
            raise RuntimeError(
                f"the compile worker gave no reply to {request} (exit {self.proc.poll()}):\n{log}"
            )
        return json.loads(line)

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """A compile worker; the module skips where this triton cannot compile for CUDA without a GPU
    (no NVIDIA backend, no ptxas): where its probe kernel does not compile."""
    w = _Worker(tmp_path_factory.mktemp("triton_cache"))
    try:
        probe = w.ask({"probe": True})
        if not probe["ok"]:
            reason = probe["error"].strip().splitlines()[-1]
            pytest.skip(f"this triton cannot compile for {TARGET} here: {reason}")
        yield w
    finally:
        w.close()


def _check(worker, path, params):
    reply = worker.ask({"path": path, "params": params})
    if not reply["ok"]:
        pytest.fail(f"{path} {params} does not compile for {TARGET}:\n{reply['error']}", pytrace=False)


@pytest.mark.parametrize("path,params", FAST)
def test_compiles_for_sm90(worker, path, params):
    _check(worker, path, params)


@pytest.mark.slow
@pytest.mark.parametrize("path,params", SLOW)
def test_compiles_for_sm90_full_grid(request, path, params):
    if "slow" not in (request.config.option.markexpr or ""):
        pytest.skip("the full grid takes minutes: run with `pytest -m slow`")
    _check(request.getfixturevalue("worker"), path, params)


def _kernel_modules() -> types.SimpleNamespace:
    """moerun.kernels' modules as this process imported them (their kernels interpreted or not)."""
    package = importlib.import_module("moerun.kernels")
    names = [info.name for info in pkgutil.iter_modules(package.__path__)]
    return types.SimpleNamespace(**{n: importlib.import_module(f"moerun.kernels.{n}") for n in names})


def test_cases_cover_every_launched_kernel():
    """Every kernel a launcher in moerun/kernels starts (`name[grid](...)`) has cases in FAST."""
    launched = set()
    for short, module in vars(_kernel_modules()).items():
        for name in re.findall(r"\b(\w+)\[[^\[\]]+\]\(", inspect.getsource(module)):
            if isinstance(getattr(module, name, None), KernelInterface):
                launched.add(f"{short}.{name}")
    assert launched, "no launches found: has the launch syntax changed?"
    covered = {p.values[0] for p in FAST}
    assert launched <= covered, f"kernels without a compile case: {sorted(launched - covered)}"
    assert covered <= set(BUILDERS)


def test_cases_cover_every_format():
    """FORMATS, Q8_1_FORMATS and ACTS are every format and activation the kernels take."""
    kernels = _kernel_modules()
    assert list(kernels.weights.FORMAT_NAMES) == FORMATS
    codes = kernels.weights.FORMAT_CODES
    assert {codes[f] for f in Q8_1_FORMATS} == set(kernels.decode_q8_1.Q8_1_GROUP_BYTES)
    activation = kernels.activation
    assert set(ACTS) == {*activation._GLU_CODES, "gpt_oss"}
    assert {activation.activation_args(a, INTERMEDIATE)["ACT"] for a in ACTS.values()} == {
        *activation._GLU_CODES.values(),
        activation._GPT_OSS_CODE,
    }


if __name__ == "__main__":
    _serve()
