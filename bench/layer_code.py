"""Issue 32 item 4: Inductor's Triton code for one drafter layer, made on a CPU-only machine, and what
it moves: how the DFlash2 convolutions' cost was found and predicted without a GPU (bench/results/kernels.md 2026-12-04 "DFlash2's convolutions rewritten for Inductor").

    python3 bench/layer_code.py dump dflash2 [--conv-kernel torch|autograd] [--conv-input inductor|triton|torch]
        [--out code.txt] [--shape 6,171,32,4096,12288]
    python3 bench/layer_code.py ptx code.txt KERNEL_SUBSTRING [--consts XBLOCK=1024] [--warps 4]

`dump`: one DrafterLayer (attention replaced by its q/k/v/o projections and an element-wise mix, the same for both
archs) compiled forward + backward under bf16 autocast with Inductor's Triton back-end forced on the CPU device
(`cpu_backend = "triton"`); the kernels and GEMMs are never run (stubbed: only the code is wanted). Prints, per
graph, each kernel that touches >= 50 MB with the summed size of its pointer arguments (an upper bound on its
bytes: a broadcast read counts whole; inputs of unknown dtype count as bf16) and the activations the forward saves
for the backward. Caveats: the CPU device's properties steer a few choices (split reductions; mix-order reductions
are GPU-only), so the GPU's code differs in places; the bytes are a model, and the convolutions' kernels turned out
issue-bound on the H200 (~1.7 TB/s), so time follows bytes only roughly. `--conv-input`: the input side's backward
as BlockConv.input_backward_kernel (the input-side kernel; "triton": the custom op an extern call whose launch is stubbed, its
traffic not counted: add it by hand). `ptx`: compile one kernel of such a dump for sm_90 (no GPU needed) and count
its global loads by width and its PTX instructions.

Both lean on torch/triton internals (torch 2.13, triton 3.9 on the CPU machine): a bench tool, not a test.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib.util
import io
import re
import sys
from math import prod
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BYTES = {"torch.float32": 4, "torch.bfloat16": 2, "torch.int64": 8, "torch.bool": 1, "torch.int32": 4}


def _force_triton_codegen_on_cpu() -> None:
    import torch._functorch.config as functorch_config
    import torch._inductor.async_compile as async_compile
    import torch._inductor.config as inductor_config
    import torch.utils._triton as torch_triton
    from torch._inductor.select_algorithm import extern_kernels

    torch_triton.triton_hash_with_backend = lambda: "cpu-codegen"  # no GPU driver to ask
    torch_triton.triton_backend = lambda: None

    class _Stub:  # a kernel that is never compiled nor run
        def __getattr__(self, name):
            return lambda *a, **k: None

    async_compile.AsyncCompile.triton = lambda self, *a, **k: _Stub()
    for name in ("mm", "addmm", "bmm"):
        setattr(extern_kernels, name, lambda *a, **k: None)
    functorch_config.force_non_lazy_backward_lowering = True
    inductor_config.cpu_backend = "triton"


def dump(arch: str, conv_kernel: str, shape: str, conv_input: str = "inductor") -> str:
    """Inductor's output code (forward and backward) of one layer, as one text."""
    import logging

    import torch
    from torch import nn

    _force_triton_codegen_on_cpu()
    from tests.trainer.tiny import build_tiny_target, tiny_drafter_config
    from trainer.model.drafter import DrafterLayer

    R, N, B, H, inner = (int(v) for v in shape.split(","))
    cfg = tiny_drafter_config(build_tiny_target(seed=0), block_size=B)
    cfg = dataclasses.replace(cfg, arch=arch, hidden_size=H, intermediate_size=inner, conv_group_size=16)

    class Attention(nn.Module):  # q/k/v from x, an element-wise mix standing in for attention, o_proj
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.o_proj = nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False)
            self.k_proj, self.v_proj = nn.Linear(H, 1024, bias=False), nn.Linear(H, 1024, bias=False)

        def forward(self, x, *_):
            xq, xk, xv = x if isinstance(x, tuple) else (x, x, x)  # DFlash2's views (BlockConv.prepare)
            q, k, v = self.q_proj(xq), self.k_proj(xk), self.v_proj(xv)
            return self.o_proj(q * (k * v).repeat(1, 1, H // 1024))

    layer = DrafterLayer(cfg, "full_attention")
    layer.self_attn = Attention()
    for conv in (layer.attention_conv, layer.mlp_conv):
        if conv is not None:
            conv.kernel = conv_kernel
            conv.input_backward_kernel = conv_input
            conv._input_mode = lambda x: conv_input  # type: ignore[method-assign]  # "triton" on the CPU device too
    if conv_input == "triton":  # the op's launch never runs (its outputs are never read): only the code is wanted
        from trainer.kernels import triton_fit

        triton_fit.launch_first_fit = lambda name, kernel, ladder, launch, *a: launch(ladder[0])  # type: ignore
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    torch._logging.set_logs(output_code=True)
    logging.getLogger("torch._inductor.codecache").addHandler(handler)
    logging.getLogger("torch._inductor.graph").addHandler(handler)
    compiled = torch.compile(lambda t: layer(t, None, None, None, None))
    x = torch.empty(R, N * B, H, dtype=torch.bfloat16, requires_grad=True)  # never written: nothing runs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = compiled(x)
    y.backward(torch.empty_like(y))
    return stream.getvalue()


def summarize(text: str, threshold: float = 50e6) -> None:
    graphs = text.split("def call(self, args):")[1:]
    for index, graph in enumerate(graphs):
        body = graph.split("\ndef ")[0]
        sizes: dict[str, tuple[int, int | None]] = {}
        for m in re.finditer(r"assert_size_stride\((\w+), \(([^)]*)\)", body):
            sizes.setdefault(m.group(1), (prod(int(v) for v in m.group(2).split(",") if v.strip()), None))
        for m in re.finditer(r"(\w+) = empty_strided_\w+\(\(([^)]*)\), \([^)]*\), (torch\.\w+)\)", body):
            sizes[m.group(1)] = (prod(int(v) for v in m.group(2).split(",") if v.strip()), BYTES[m.group(3)])
        for m in re.finditer(r"(\w+) = reinterpret_tensor\((\w+),", body):
            if m.group(2) in sizes:
                sizes.setdefault(m.group(1), sizes[m.group(2)])
        total = 0
        print(f"graph {index} ({'forward' if index == 0 else 'backward'})")
        for m in re.finditer(r"(triton_\w+)\.run\((.*)\)\s*$", body, re.M):
            names = [a.strip() for a in m.group(2).split(",")]
            moved = sum(sizes[a][0] * (sizes[a][1] or 2) for a in names if a in sizes)
            if moved >= threshold:
                total += moved
                print(f"  {moved / 1e6:8.0f} MB  {m.group(1)[:100]}")
        print(f"  total {total / 1e9:.2f} GB in kernels of >= {threshold / 1e6:.0f} MB")
    tail = text.split("def call(self, args):")[2] if len(graphs) > 1 else ""
    saved = 0
    for m in re.finditer(r"(\w+) = rand_strided\(\(([^)]*)\), \([^)]*\), device='cpu', dtype=(torch\.\w+)\)", tail):
        if not m.group(1).startswith(("tangents", "permute", "primals")):
            saved += prod(int(v) for v in m.group(2).split(",") if v.strip()) * BYTES[m.group(3)]
    print(f"saved for the backward (activations, not parameters): {saved / 1e9:.2f} GB")


def ptx(text: str, want: str, consts: dict[str, int], warps: int) -> None:
    import torch._inductor.runtime.triton_helpers as triton_helpers
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    triton_helpers.set_driver_to_cpu = lambda: None
    pattern = r"(\w+) = async_compile\.triton\('(\w+)', '''(.*?)''', device_str='cpu'\)"
    for m in re.finditer(pattern, text, re.S):
        name, source = m.group(2), m.group(3)
        if want not in name:
            continue
        signature = eval(re.search(r"'signature': (\{[^}]*\})", source).group(1))  # our own dump's literal
        path = Path("/tmp") / f"layer_code_{name[:60]}.py"
        path.write_text(source[: source.index("@triton_heuristics")] + source[source.index("@triton.jit") :])
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        constexprs = {k: v for k, v in consts.items() if k in signature}
        types = {k: ("constexpr" if k in constexprs else v) for k, v in signature.items()}
        aligned = {(i,): [["tt.divisibility", 16]] for i, (k, v) in enumerate(signature.items()) if v.startswith("*")}
        source_ast = ASTSource(getattr(module, name), types, constexprs, aligned)
        binary = triton.compile(source_ast, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        code = binary.asm["ptx"]
        loads = collections.Counter(re.sub(r"\.L[12]::\w+", "", op) for op in re.findall(r"(ld\.global[\.\w:]*)", code))
        body = [ln for ln in code.splitlines() if ln.strip() and not ln.strip().startswith(("//", ".", "$", "{", "}"))]
        print(f"{name[:100]} {constexprs} warps {warps}: loads {dict(loads)}, {len(body)} PTX instructions")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    d = sub.add_parser("dump")
    d.add_argument("arch", choices=("dflash", "dflash2"))
    d.add_argument("--conv-kernel", default="torch", choices=("torch", "autograd"))
    d.add_argument("--shape", default="6,171,32,4096,12288", help="rows,blocks,block,hidden,intermediate")
    d.add_argument("--conv-input", default="inductor", choices=("inductor", "triton", "torch"))
    d.add_argument("--out", default="", help="write the output code here too")
    p = sub.add_parser("ptx")
    p.add_argument("code")
    p.add_argument("kernel", help="a substring of the kernel's name")
    p.add_argument("--consts", default="XBLOCK=1024")
    p.add_argument("--warps", type=int, default=4)
    args = parser.parse_args()
    if args.verb == "dump":
        with contextlib.redirect_stderr(io.StringIO()):
            text = dump(args.arch, args.conv_kernel, args.shape, args.conv_input)
        text = re.sub(r"^[VI]\d{4} [^\]]*\] \[[^\]]*\] \[__output_code\] ", "", text, flags=re.M)
        if args.out:
            Path(args.out).write_text(text)
        summarize(text)
    else:
        consts = {k: int(v) for k, v in (kv.split("=") for kv in args.consts.split(","))}
        ptx(Path(args.code).read_text(), args.kernel, consts, args.warps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
