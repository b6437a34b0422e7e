"""Writing LLVM IR as text: a function body with named values, counted loops and stack slots, and
the vector operands the weight kernels use (``cpu.fused_product``)."""
from __future__ import annotations


def vec(ty: str, values) -> str:
    """A constant vector operand (its type given by the instruction)."""
    return "<" + ", ".join(f"{ty} {v}" for v in values) + ">"


def splat(ty: str, n: int, v) -> str:
    return vec(ty, [v] * n)


def lanes(lo: int, hi: int) -> str:
    """The shuffle mask that takes lanes [lo, hi)."""
    return f"<{hi - lo} x i32> " + vec("i32", range(lo, hi))


def interleave(n: int) -> str:
    """The shuffle mask that takes lane i of two n-lane vectors in turn: a0, b0, a1, b1, ..."""
    return f"<{2 * n} x i32> " + vec("i32", [i // 2 + (i % 2) * n for i in range(2 * n)])


class Function:
    """Text of one LLVM function body: ``let`` names a value, ``loop`` a counted loop, ``slot`` a stack
    slot (loop counters, accumulators) placed in the entry block, where the optimiser turns it into a
    register."""

    def __init__(self):
        self.lines: list[str] = []
        self.slots: list[str] = []
        self.n = 0

    def slot(self, ty: str, align: int = 8) -> str:
        self.n += 1
        name = f"%slot{self.n}"
        self.slots.append(f"  {name} = alloca {ty}, align {align}")
        return name

    def text(self, header: str, footer: list[str]) -> str:
        return "\n".join([header, "entry:", *self.slots, *self.lines, "}", *footer])

    def let(self, expr: str) -> str:
        self.n += 1
        name = f"%t{self.n}"
        self.lines.append(f"  {name} = {expr}")
        return name

    def do(self, stmt: str) -> None:
        self.lines.append(f"  {stmt}")

    def loop(self, lo: str, hi: str, step: int, body) -> None:
        """for i in range(lo, hi, step): body(i)"""
        self.n += 1
        tag = self.n
        slot = self.slot("i64")
        self.do(f"store i64 {lo}, ptr {slot}")
        self.do(f"br label %head{tag}")
        self.lines.append(f"head{tag}:")
        i = self.let(f"load i64, ptr {slot}")
        more = self.let(f"icmp slt i64 {i}, {hi}")
        self.do(f"br i1 {more}, label %body{tag}, label %done{tag}")
        self.lines.append(f"body{tag}:")
        body(i)
        self.do(f"store i64 {self.let(f'add i64 {i}, {step}')}, ptr {slot}")
        self.do(f"br label %head{tag}")
        self.lines.append(f"done{tag}:")

    def when(self, cond: str, body) -> None:
        """if cond: body()"""
        self.n += 1
        tag = self.n
        self.do(f"br i1 {cond}, label %then{tag}, label %after{tag}")
        self.lines.append(f"then{tag}:")
        body()
        self.do(f"br label %after{tag}")
        self.lines.append(f"after{tag}:")

    def broadcast(self, ty: str, value: str, n: int) -> str:
        one = self.let(f"insertelement <{n} x {ty}> poison, {ty} {value}, i64 0")
        return self.let(f"shufflevector <{n} x {ty}> {one}, <{n} x {ty}> poison, <{n} x i32> zeroinitializer")

    def halves(self, ty: str, wide: str) -> list[str]:
        """A 32-lane vector's lanes 0-15 and 16-31."""
        return [self.let(f"shufflevector <32 x {ty}> {wide}, <32 x {ty}> poison, {lanes(16 * h, 16 * h + 16)}")
                for h in (0, 1)]
