"""Hostile constraints and tools (issue 60). A schema, grammar or regex past the depth or size a
constraint may have is a 400 naming the field and the limit, before anything compiles it; one that
passes those bounds and still crashes the grammar library, or runs past the compile budget, costs
its own request (compiled first in a process of its own), never the server; compiles run on
threads of their own, so a request without a constraint is not held behind them; a malformed tool
schema is a 400 naming the field, as a malformed response_format schema is;
``truncate_prompt_tokens: -1`` keeps what the server takes. The checks run as the server runs them
(``schema.generation`` on a check thread, then ``schema.constrained``) on the TINY checkpoint's
V4.1 chat format; then the same hostile requests against ``python -m dsv41.serve``, which answers
``/health`` after each."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from dsv41.checkpoint.text import TextCodec
from dsv41.serving import constraint_bounds, schema, structured

httpx = pytest.importorskip("httpx")
pytest.importorskip("llguidance")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LIMITS = schema.Limits(max_context=2048, max_prompt=2047, vocab_size=0, max_body_bytes=1 << 20)
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def compiler(codec):
    return structured.Compiler(codec, codec.size)


def _limits(codec) -> schema.Limits:
    return schema.Limits(LIMITS.max_context, LIMITS.max_prompt, codec.size, LIMITS.max_body_bytes)


def _check(codec, compiler, chat=True, **fields) -> schema.Generation:
    """As the server: checked, then its constraint compiled."""
    body = {"messages": HI, **fields} if chat else fields
    gen = schema.generation(schema.parse_body(json.dumps({"max_tokens": 1, **body}).encode(), _limits(codec)),
                            chat, codec, _limits(codec))
    return gen if gen.constraint is None else schema.constrained(gen, compiler)


def _refused(codec, compiler, param: str, chat=True, **fields) -> str:
    with pytest.raises(schema.ApiError) as e:
        _check(codec, compiler, chat, **fields)
    assert (e.value.status, e.value.param) == (400, param), e.value.message
    assert e.value.message.startswith(param + ":")
    return e.value.message


def _tool(parameters) -> list:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


P = "tools[0].function.parameters"
MALFORMED = [
    ({"type": "object", "properties": {"s": {"type": "string", "minLength": "abc"}}}, P + ".properties.s.minLength"),
    ({"type": "object", "properties": {"s": {"type": "string", "minLength": None}}}, P + ".properties.s.minLength"),
    ({"type": "object", "properties": {"s": {"type": "string", "minLength": [1]}}}, P + ".properties.s.minLength"),
    ({"type": "object", "properties": {"s": {"type": "string", "maxLength": -1}}}, P + ".properties.s.maxLength"),
    ({"type": "object", "properties": {"s": {"type": "string", "minLength": 3, "maxLength": 2}}},
     P + ".properties.s.maxLength"),
    ({"type": "object", "properties": {"s": {"type": "string", "enum": "ab"}}}, P + ".properties.s.enum"),
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": 5}}}, P + ".properties.s.pattern"),
    ({"type": "object", "properties": {"s": 5}}, P + ".properties.s"),
    ({"type": "object", "properties": ["s"]}, P + ".properties"),
    ({"type": "object", "properties": "s"}, P + ".properties"),
    ({"type": "object", "properties": {"s": {"type": "string"}}, "required": 5}, P + ".required"),
    ({"type": "object", "properties": {"s": {"type": "string"}}, "required": [5]}, P + ".required"),
    ([{"type": "object"}], P),
    ("object", P),
]


@pytest.mark.timeout(300)   # compiles in processes it starts (each waited for, or killed at its budget)
@pytest.mark.parametrize("parameters,param", MALFORMED, ids=[p for _, p in MALFORMED])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}],
                         ids=["required", "named"])
def test_a_malformed_tool_schema_is_a_400_naming_the_field(codec, compiler, parameters, param, choice):
    """Each used to be a 500 with a traceback (int("abc"), .items() of a list, set(5))."""
    _refused(codec, compiler, param, tools=_tool(parameters), tool_choice=choice)
    good = {"type": "object", "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 4}},
            "required": ["s"]}
    assert _check(codec, compiler, tools=_tool(good), tool_choice=choice).params.grammar is not None


def test_truncating_to_what_the_server_takes_keeps_max_model_len_less_one(codec, compiler):
    """-1 keeps as many tokens as the server accepts: max_model_len - 1 (a row is left for the
    answer's first token), the last ones; one more is refused as too long."""
    prompt = [(5 * i) % 300 + 3 for i in range(3000)]
    gen = _check(codec, compiler, chat=False, prompt=prompt, truncate_prompt_tokens=-1)
    assert gen.prompt == prompt[-2047:] and LIMITS.max_prompt == LIMITS.max_context - 1 == 2047
    assert _check(codec, compiler, chat=False, prompt=prompt, truncate_prompt_tokens=2047).prompt == gen.prompt
    _refused(codec, compiler, "prompt", chat=False, prompt=prompt, truncate_prompt_tokens=2048)


# ---- constraints past the bounds, and what passes them ---------------------------------------------------
def ref_chain(n: int, step=lambda target: {"$ref": target}) -> dict:
    """A schema n levels deep through $ref: definition i is step(a reference to definition i + 1)."""
    defs = {f"d{i}": step(f"#/$defs/d{i + 1}") for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def anchor_chain(n: int) -> dict:
    """An object n levels deep through $ref to $anchor names: llguidance follows them, the bounds
    do not (they follow JSON pointers), so it passes them; ~1,200 levels overflow an 8 MiB stack."""
    defs = {f"{i}": {"$anchor": f"a{i}", "type": "object", "properties": {"a": {"$ref": f"#a{i + 1}"}}}
            for i in range(n)}
    defs[f"{n}"] = {"$anchor": f"a{n}", "type": "integer"}
    return {"$defs": defs, "$ref": "#a0"}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1} | "b"\n' for i in range(n)) + f'r{n} ::= "z"\n'


def json_format(schema_: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema_}}}


def deep_tool(n: int) -> dict:
    return {"tools": _tool({"type": "object", "properties": {"x": ref_chain(n)}, "required": ["x"]}),
            "tool_choice": "required"}


# (name, request fields, the field refused): each used to overflow the checking thread's stack
DEEP = [
    ("$ref chain", json_format(ref_chain(2500)), "response_format"),
    ("anyOf chain", json_format(ref_chain(1500, lambda t: {"anyOf": [{"$ref": t}, {"type": "null"}]})),
     "response_format"),
    ("object chain", json_format(ref_chain(1200, lambda t: {"type": "object", "properties": {"a": {"$ref": t}}})),
     "response_format"),
    ("nested text", {"guided_json": '{"anyOf": [' * 2500 + '{"type": "integer"}' + "]}" * 2500}, "guided_json"),
    ("lark chain", {"guided_grammar": lark_chain(3000)}, "guided_grammar"),
    ("gbnf chain", {"guided_grammar": gbnf_chain(1000)}, "guided_grammar"),
    ("lark %json chain", {"guided_grammar": "start: %json " + json.dumps(ref_chain(1500))}, "guided_grammar"),
    ("regex groups", {"guided_regex": "(" * 300 + "a" + ")" * 300}, "guided_regex"),
    ("tool chain", deep_tool(1500), "tool_choice"),
]


@pytest.mark.parametrize("fields,param", [d[1:] for d in DEEP], ids=[d[0] for d in DEEP])
def test_a_constraint_past_the_depth_bound_is_refused_before_it_compiles(codec, fields, param):
    """Refused by the checks themselves (``generation`` compiles nothing), naming the limit; a
    context large enough that the tool's schema in the prompt is not refused first."""
    limits = schema.Limits(1 << 20, (1 << 20) - 1, codec.size, 1 << 22)
    with pytest.raises(schema.ApiError) as e:
        schema.generation(schema.parse_body(json.dumps({"messages": HI, "max_tokens": 1, **fields}).encode(), limits),
                          True, codec, limits)
    assert (e.value.status, e.value.param) == (400, param), e.value.message
    assert f"over the limit of {constraint_bounds.MAX_DEPTH} levels" in e.value.message


@pytest.mark.timeout(300)   # compiles in processes it starts (each waited for, or killed at its budget)
def test_the_bounds_measure_what_the_compiler_descends(codec, compiler):
    """Depth counted through $ref (a recursive schema's step back counts once), rule chains, groups
    and %json; size in bytes. Real constraints pass, and compile."""
    assert constraint_bounds.schema_depth(json.dumps(ref_chain(100))) == 100 + 3
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    assert constraint_bounds.schema_depth(json.dumps(tree)) == 4        # its $ref back to the root: cut
    assert constraint_bounds.grammar_depth(lark_chain(50)) == 52
    assert constraint_bounds.grammar_depth(gbnf_chain(50)) == 52
    assert constraint_bounds.grammar_depth('start: "a" %json {"properties": {"a": {"type": "string"}}}') == 4
    assert constraint_bounds.regex_depth(r"(a(b)[(((]\(c)") == 2
    for fields in (json_format(tree), json_format(ref_chain(40)), {"guided_grammar": lark_chain(100)},
                   {"guided_grammar": 'start: expr\nexpr: term ("+" term)*\nterm: /[0-9]+/ | "(" expr ")"'}):
        assert _check(codec, compiler, **fields).params.grammar is not None
    big = {"guided_choice": [f"choice number {i}" for i in range(8000)]}
    message = _refused(codec, compiler, "guided_choice", **big)
    assert f"over the limit of {constraint_bounds.MAX_BYTES} bytes" in message


@pytest.mark.timeout(300)   # compiles in processes it starts (each waited for, or killed at its budget)
def test_a_compile_that_crashes_or_runs_past_its_budget_costs_its_request_alone(codec, compiler):
    """A schema deep through $anchor references passes the bounds and overflows the stack of the
    process that compiles it first: that process dies (SIGSEGV), the request is a 400 naming the
    field, this process lives on and compiles the next one. A budget shorter than a compile's
    process can start in refuses every new constraint, naming the budget, and kills the process."""
    deep = anchor_chain(1200)
    assert constraint_bounds.schema_depth(json.dumps(deep)) < constraint_bounds.MAX_DEPTH
    message = _refused(codec, compiler, "response_format", **json_format(deep))
    assert "the grammar compiler failed on it (SIGSEGV)" in message
    assert _check(codec, compiler, **json_format(ref_chain(5))).params.grammar is not None
    hurried = structured.Compiler(codec, codec.size, budget_s=0.01)
    try:
        message = _refused(codec, hurried, "guided_regex", guided_regex="[0-9]{5}")
        assert "not compiled within the compile budget of 0.01 s" in message
    finally:
        hurried.close()


# what a compile thread holds: the deepest $ref chain of objects above as llguidance's grammar,
# compiled on one of the Compiler's threads, or on a thread of the default stack size
STACK_SCRIPT = """
import json, sys, threading
from dsv41.checkpoint.text import TextCodec
from dsv41.engine.grammar import Grammar
from dsv41.serving import grammar_check, structured
codec = TextCodec.load(sys.argv[1])
compiler = structured.Compiler(codec, codec.size)
spec = grammar_check.spec("json", sys.stdin.read())
if sys.argv[2] == "compile":
    compiler.submit(Grammar, compiler.table, spec, "x").result()
else:
    t = threading.Thread(target=Grammar, args=(compiler.table, spec, "x"))
    t.start()
    t.join()
print("compiled")
"""


@pytest.mark.timeout(600)
def test_a_compile_thread_holds_what_overflows_a_default_thread(tiny_checkpoint):
    """Why the server compiles on threads of COMPILE_STACK_BYTES: a grammar that compiled in the
    checking process (8 MiB main thread) is compiled again in the server; a 2,500-level chain kills
    a process on a default thread and compiles on a compile thread (each in a process of its own)."""
    chain = json.dumps(ref_chain(2500, lambda t: {"type": "object", "properties": {"a": {"$ref": t}}}))
    runs = {}
    for where in ("compile", "default"):
        p = subprocess.run([sys.executable, "-c", STACK_SCRIPT, str(tiny_checkpoint), where], input=chain, text=True,
                           capture_output=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
        runs[where] = (p.returncode, p.stdout.strip())
    assert runs == {"compile": (0, "compiled"), "default": (-signal.SIGSEGV, "")}, runs


# ---- compiles never hold a request without a constraint --------------------------------------------------
def flat_gbnf(tag: int, rules: int = 1800) -> str:
    """A ~60 KB GBNF: one alternative per rule (shallow, distinct per tag)."""
    return ("root ::= " + " | ".join(f"r{i}" for i in range(rules)) + "\n" +
            "".join(f'r{i} ::= "t{tag}w{i}" [a-z]{{1,3}}\n' for i in range(rules)))


@pytest.mark.timeout(600)
def test_heavy_compiles_do_not_hold_a_request_without_a_constraint(tiny_checkpoint, monkeypatch):
    """Four 60 KB GBNF requests whose in-server compiles are held (a gate in ``Grammar``, standing in
    for minutes of work) and then a 2-token request with no constraint: it is answered while all
    four are still held (ordering, not time: the wait is only a hang guard), at most COMPILES of them
    compile at once, and each is answered once let go. On a server that compiled on its two
    request-checking threads, the 2-token request waited for them."""
    from dsv41.engine import grammar
    from test_serve_features import InProcess
    gate, lock = threading.Event(), threading.Lock()
    inside, peak = [0], [0]
    compile_ = grammar.Grammar.__init__

    def held(self, table, spec, name):
        with lock:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
        gate.wait(300)
        with lock:
            inside[0] -= 1
        compile_(self, table, spec, name)

    monkeypatch.setattr(grammar.Grammar, "__init__", held)
    server = InProcess(TextCodec.load(tiny_checkpoint))
    server.engine.answer("ok")
    answers = {}

    def send(key, body):
        answers[key] = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, **body},
                                  timeout=600).status_code

    heavy = [threading.Thread(target=send, args=(i, {"guided_grammar": flat_gbnf(i)})) for i in range(4)]
    try:
        for t in heavy:
            t.start()
        deadline = time.monotonic() + 300
        while inside[0] < structured.COMPILES and time.monotonic() < deadline:
            time.sleep(0.05)
        assert inside[0] == structured.COMPILES
        plain = threading.Thread(target=send, args=("plain", {}))
        plain.start()
        plain.join(120)                       # a hang guard: the assertion is that it ended while held
        answered_while_held = not plain.is_alive() and not gate.is_set()
    finally:
        gate.set()
        for t in heavy:
            t.join(300)
        server.stop()
    assert answered_while_held and answers["plain"] == 200
    assert peak[0] == structured.COMPILES and [answers[i] for i in range(4)] == [200] * 4


# ---- the same through python -m dsv41.serve --------------------------------------------------------------
@pytest.mark.timeout(900)
def test_no_hostile_constraint_takes_the_server_down(tiny_checkpoint):
    """Each deep case (and the one that passes the bounds and crashes the compiler) is a 400 naming
    its field, and the server answers /health after each and a plain constrained request at the
    end. The tool's chain makes a prompt longer than the context: refused for that, before any
    compile (on a server that compiled first, it was the crash)."""
    from test_serve_hostile import Served
    server = Served("--checkpoint", str(tiny_checkpoint), "--max-context", "1024", "--max-body-bytes", str(1 << 22))
    try:
        cases = DEEP + [("anchor chain", json_format(anchor_chain(1200)), "response_format")]
        for name, fields, param in cases:
            status, body = server.post("/v1/chat/completions", {"messages": HI, "max_tokens": 2, **fields})
            assert (status, body["error"]["param"]) == (400, param), (name, body)
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200, name
        status, body = server.post("/v1/chat/completions", {"messages": HI, "max_tokens": 8, "temperature": 0,
                                                            **json_format({"type": "integer"})})
        assert status == 200 and body["choices"][0]["message"]["content"]
        assert server.proc.poll() is None
    finally:
        server.stop()
