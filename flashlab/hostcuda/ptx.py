"""Inline PTX made host C++: the rewriting that lets g++ compile a tensor-core kernel against ``cuda_host.h``.

A kernel reaches the tensor cores and the asynchronous copies through inline PTX, which g++ cannot run. Two kinds
of rewriting make such a kernel host C++, both done by :func:`host_source`:

* the course's kernel files wrap their PTX in small device helpers (``ldsm_x4``, ``cp_async16``, ``ex2``...) and
  conversion structs (``F16``, ``BF16``): those definitions are removed, and ``cuda_host.h``'s host versions of the
  same names stand in;
* an ``asm`` statement written inline (a learner's ``mma.sync`` line, lab 07) is parsed — its instruction, its
  output and input operands — and replaced by a call of the header's warp-level emulation with the operands'
  own expressions: ``ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16``,
  ``mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32``,
  ``mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32`` and ``mov.u32``. Outputs are written after every input
  is read, as the instruction does. The replacement keeps the statement's line count, so that the compiler's line
  numbers still point at the kernel's own lines.

Any other inline PTX is refused with :class:`UnknownPTX` rather than run wrongly. The rewriting is text
processing only (no compiler runs), so it may be applied to untrusted source before a sandboxed compile.
"""

from __future__ import annotations

import re

# Each kernel file's conversion structs (PTX cvt and mma bodies): replaced by cuda_host.h's host versions, F16 by
# HostF16 and BF16 by HostBF16.
HOST_TYPES = ("F16", "BF16")
# Device helpers whose bodies are inline PTX: removed, the header's host versions (same names) stand in.
PTX_HELPERS = ("ex2", "smem_addr", "ldsm_x4", "ldsm_x4_t", "cp_async16", "cp_async_commit", "cp_async_wait",
               # kernels/hopper/wgmma.cuh: its wgmma structs (HOPPER_STRUCTS) go too, cuda_host.h emulates them
               "smem_u32", "wgmma_fence", "wgmma_commit", "wgmma_wait", "pin", "fence_to_tensor_cores",
               # and kernels/hopper/tma.cuh's
               "mbar_init", "fence_barrier_init", "mbar_expect_tx", "mbar_try_wait", "tma_load_3d", "tma_load_4d",
               "mbar_arrive",
               "setmaxnreg_dec", "setmaxnreg_inc", "named_bar_sync", "named_bar_arrive",
               # and kernels/hopper/epilogue.cuh's
               "stsm_x4", "lds_v4", "stg_v4",
               # and the Hopper backward's (kernels/hopper/bwd_h*.cu)
               "red_add_v2", "hold", "bulk_reduce_add", "bulk_commit", "bulk_wait_read", "bulk_wait",
               # and the fused decoding kernel's (kernels/decode_r3_mma.cu)
               "arrive_acq_rel",
               # and decoding's programmatic dependent launch (decode_r3_mma.cu, decode_r1_split.cu)
               "let_dependents_launch", "wait_for_split_grid")
# (Wgmma<N> in wgmma.cuh; WgmmaT<N>, both operands transposed, in the Hopper backward)
HOPPER_STRUCTS = (re.compile(r"template <>\s*struct WgmmaT?<\d+> \{"),
                  re.compile(r"template <int N>\s*struct WgmmaT?;"))
ASM_REWRITES = [
    (r'asm volatile\("mov\.u32 %0, %1;" : "=r"\((\w+)\) : "r"\((\w+)\)\);', r"\1 = \2;"),
    (r'asm volatile\("mov\.u32 %0, %%ctaid\.([xyz]);" : "=r"\((\w+)\)\);', r"\2 = blockIdx.\1;"),
    (r"extern __shared__ __align__\(16\) u16 smem\[\];", "u16* smem = (u16*)g_arena;"),
    (r"extern __shared__ __align__\(16\) unsigned char (\w+)\[\];", r"unsigned char* \1 = g_arena;"),
]
#: The instructions an inline ``asm`` statement may hold, in words (for messages).
KNOWN = ("ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16, mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
         "(or .bf16.bf16), mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32, mov.u32")


class UnknownPTX(ValueError):
    """An ``asm`` statement the host rewriting cannot run (an instruction it does not know, or malformed)."""


def _definition_span(src: str, start: int) -> tuple[int, int]:
    """[start, end) of the definition beginning at ``start``: through its matching closing brace (and a ';')."""
    i = src.index("{", start)
    depth = 0
    while True:
        if src[i] == "{":
            depth += 1
        elif src[i] == "}":
            depth -= 1
            if depth == 0:
                end = i + 1
                return start, end + 1 if src[end:end + 1] == ";" else end
        i += 1


# ------------------------------------------------------------------------------------ parsing an asm statement
_ASM = re.compile(r"\basm\s*(?:volatile\s*|__volatile__\s*)?\(")
_STRING = re.compile(r'"((?:[^"\\\n]|\\.)*)"')


def _closing(src: str, i: int) -> int:
    """Index just past the ')' closing the '(' at ``i - 1``, skipping string literals."""
    depth = 1
    while i < len(src):
        ch = src[i]
        if ch == '"':
            m = _STRING.match(src, i)
            if m is None:
                raise UnknownPTX("an asm statement has an unterminated string")
            i = m.end()
            continue
        depth += ch == "("
        depth -= ch == ")"
        i += 1
        if depth == 0:
            return i
    raise UnknownPTX("an asm statement has no closing parenthesis")


def _split(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside parentheses, brackets and strings."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        ch = text[i]
        if ch == '"':
            m = _STRING.match(text, i)
            i = m.end() if m else len(text)
            continue
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    parts.append(text[start:])
    return parts


def _operands(section: str) -> list[tuple[str, str]]:
    """(constraint, expression) of each ``"c"(expr)`` of an operand list."""
    out = []
    for item in _split(section, ","):
        item = item.strip()
        if not item:
            continue
        m = re.fullmatch(r'"([^"]*)"\s*\((.*)\)', item, re.S)
        if m is None:
            raise UnknownPTX(f"cannot read the asm operand {item!r} (expected \"constraint\"(expression))")
        out.append((m.group(1), m.group(2).strip()))
    return out


def _instruction(body: str) -> tuple[str, list[tuple[str, str]], list[tuple[str, str]]]:
    """The instruction text, outputs and inputs of the inside of ``asm(...)``."""
    sections = _split(body, ":")
    strings = _STRING.findall(sections[0])
    if not strings or _STRING.sub("", sections[0]).strip():
        raise UnknownPTX("an asm statement must begin with its instruction as a string literal")
    text = "".join(strings).replace("\\n", " ").replace("\\t", " ")
    outputs = _operands(sections[1]) if len(sections) > 1 else []
    inputs = _operands(sections[2]) if len(sections) > 2 else []
    return " ".join(text.split()), outputs, inputs


_REG = r"(%%?\w+(?:\.\w+)?)"
_LIST = r"\{\s*" + r"\s*,\s*".join([_REG] * 4) + r"\s*\}"
_PATTERNS = {
    "ldmatrix": re.compile(r"ldmatrix\.sync\.aligned\.m8n8\.x4(\.trans)?\.shared(?:::cta)?\.b16 " + _LIST
                           + r"\s*,\s*\[\s*" + _REG + r"\s*\]\s*;?"),
    "mma16": re.compile(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(f16|bf16)\.(f16|bf16)\.f32 " + _LIST
                        + r"\s*,\s*" + _LIST + r"\s*,\s*\{\s*" + _REG + r"\s*,\s*" + _REG + r"\s*\}\s*,\s*"
                        + _LIST + r"\s*;?"),
    "mma8": re.compile(r"mma\.sync\.aligned\.m16n8k8\.row\.col\.f32\.f16\.f16\.f32 " + _LIST + r"\s*,\s*\{\s*"
                       + _REG + r"\s*,\s*" + _REG + r"\s*\}\s*,\s*\{\s*" + _REG + r"\s*\}\s*,\s*" + _LIST + r"\s*;?"),
    "mov": re.compile(r"mov\.u32 " + _REG + r"\s*,\s*" + _REG + r"\s*;?"),
}


def _translate(text: str, outputs: list[tuple[str, str]], inputs: list[tuple[str, str]]) -> str:
    """The C++ statement that does what the PTX ``text`` does, with the operands' expressions in place."""
    operands = [*outputs, *inputs]
    written = set()

    def operand(token: str, *, out: bool = False, kind: str = "r") -> str:
        m = re.fullmatch(r"%(\d+)", token)
        if m is None:
            special = re.fullmatch(r"%%(ctaid|tid|ntid|nctaid)\.([xyz])", token)
            if special and not out:
                names = {"ctaid": "blockIdx", "tid": "threadIdx", "ntid": "blockDim", "nctaid": "gridDim"}
                return f"{names[special.group(1)]}.{special.group(2)}"
            raise UnknownPTX(f"{token} is not an operand of this asm statement (write %0, %1, ...)")
        index = int(m.group(1))
        if index >= len(operands):
            raise UnknownPTX(f"%{index} names no operand: this asm statement has {len(operands)} "
                             f"({len(outputs)} outputs, {len(inputs)} inputs; outputs are numbered first)")
        constraint, expr = operands[index]
        letters = constraint.lstrip("=+&")
        if out and index >= len(outputs):
            raise UnknownPTX(f"%{index} is written by the instruction but is an input operand (\"{constraint}\"); "
                             "a result goes in the output list, after the first ':' (\"=r\", \"=f\" or \"+f\")")
        if not out and constraint.startswith("=") and index < len(outputs):
            raise UnknownPTX(f"%{index} ({expr}) is read by the instruction, but it is an output-only operand "
                             f"(\"{constraint}\"): its value on entry is undefined, so the instruction does not "
                             f"receive {expr}. An operand both read and written takes \"+{letters}\"")
        if letters != kind:
            want = {"r": "a 32-bit register (\"r\")", "f": "a float register (\"f\")"}[kind]
            raise UnknownPTX(f"%{index} ({expr}) has the constraint \"{constraint}\" where the instruction takes "
                             f"{want}")
        if out:
            written.add(index)
        return f"({expr})"

    m = _PATTERNS["ldmatrix"].fullmatch(text)
    if m:
        regs = [operand(x, out=True) for x in m.groups()[1:5]]
        call = f"hostcuda_ldmatrix_x4({', '.join(regs)}, {operand(m.group(6))}, {'true' if m.group(1) else 'false'})"
    elif (m := _PATTERNS["mma16"].fullmatch(text)) is not None:
        if m.group(1) != m.group(2):
            raise UnknownPTX("mma.sync with A and B of different types")
        d = [operand(x, out=True, kind="f") for x in m.groups()[2:6]]
        a = [operand(x) for x in m.groups()[6:10]]
        b = [operand(x) for x in m.groups()[10:12]]
        c = [operand(x, kind="f") for x in m.groups()[12:16]]
        call = f"hostcuda_mma_m16n8k16<{m.group(1)}_val>({', '.join(d + a + b + c)})"
    elif (m := _PATTERNS["mma8"].fullmatch(text)) is not None:
        d = [operand(x, out=True, kind="f") for x in m.groups()[0:4]]
        a = [operand(x) for x in m.groups()[4:6]]
        b = [operand(m.group(7))]
        c = [operand(x, kind="f") for x in m.groups()[7:11]]
        call = f"hostcuda_mma_m16n8k8({', '.join(d + a + b + c)})"
    elif (m := _PATTERNS["mov"].fullmatch(text)) is not None:
        call = f"{operand(m.group(1), out=True)} = {operand(m.group(2))}"
    else:
        raise UnknownPTX(f"the host emulation does not know the inline PTX {text[:120]!r}: it runs {KNOWN}")
    unused = [i for i, (c, _) in enumerate(outputs) if i not in written]
    if unused:
        raise UnknownPTX(f"output operand %{unused[0]} ({outputs[unused[0]][1]}) is never written by the "
                         f"instruction {text.split()[0]}")
    return call + ";"


def rewrite_asm(src: str) -> str:
    """Every ``asm(...)`` statement of ``src`` replaced by the host call that does the same (see the module);
    comments are left alone, and each replacement keeps the statement's number of lines."""
    out, i = [], 0
    code = _blank_comments(src)
    while (m := _ASM.search(code, i)) is not None:
        end = _closing(code, m.end())
        semi = re.compile(r"\s*;").match(code, end)
        stop = semi.end() if semi else end
        text, outputs, inputs = _instruction(code[m.end():end - 1])
        out.append(src[i:m.start()])
        out.append(_translate(text, outputs, inputs) + "\n" * src.count("\n", m.start(), stop))
        i = stop
    out.append(src[i:])
    return "".join(out)


def _blank_comments(src: str) -> str:
    """``src`` with its comments' characters replaced by spaces (same length, newlines kept), strings kept."""
    out = list(src)
    pattern = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:[^"\\\n]|\\.)*"', re.S)
    for m in pattern.finditer(src):
        if m.group(0).startswith('"'):
            continue
        for j in range(m.start(), m.end()):
            if out[j] != "\n":
                out[j] = " "
    return "".join(out)


def host_source(cu_text: str) -> str:
    """A CUDA kernel's text made host C++ (before :mod:`flashlab.hostcuda` adds its header): PTX conversion
    structs replaced by the header's host versions, PTX helpers removed, inline ``asm`` statements rewritten.

    Raises :class:`UnknownPTX` for inline PTX the host emulation does not know."""
    src = cu_text
    for name in HOST_TYPES:
        if f"struct {name} {{" in src:
            a, b = _definition_span(src, src.index(f"struct {name} {{"))
            src = src[:a] + f"using {name} = Host{name};" + src[b:]
    for name in PTX_HELPERS:
        m = re.search(rf"__device__ __forceinline__ \w+ {name}\(", src)
        if m:
            a, b = _definition_span(src, m.start())
            shell = re.search(r"template <int \w+>\s*$", src[:a])
            if shell:  # keep no template shell around a removed body
                a = shell.start()
            src = src[:a] + src[b:]
    for pattern in HOPPER_STRUCTS:
        while (m := pattern.search(src)) is not None:
            a, b = (m.start(), m.end()) if m.group(0).endswith(";") else _definition_span(src, m.start())
            src = src[:a] + src[b:]
    for pattern, repl in ASM_REWRITES:
        src = re.sub(pattern, repl, src)
    return rewrite_asm(src)


__all__ = ["ASM_REWRITES", "HOPPER_STRUCTS", "HOST_TYPES", "KNOWN", "PTX_HELPERS", "UnknownPTX", "host_source",
           "rewrite_asm"]
