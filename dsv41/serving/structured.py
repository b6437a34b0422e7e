"""Structured outputs: a request's constraint fields made into a compiled grammar (llguidance,
vLLM's ``guidance`` backend) that the engine masks each drawn row with (``engine.grammar``).

The fields, with vLLM's meaning: OpenAI's ``response_format`` (``json_object``, ``json_schema``),
``tool_choice`` ``"required"`` or a named function (the DSML tool-call block the answer's parser
reads, each parameter's value constrained by its schema), vLLM's ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` (Lark or GBNF) and its newer
``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``). At
most one constraint a request. JSON is written compact (no whitespace between tokens, as vLLM's
``disable_any_whitespace``): a model cannot pad an answer with blank lines until its token limit.

A constraint is held to a size and a depth before anything compiles it (``constraint_bounds``),
and compiled only after every cheaper check of its request has passed, on threads of its own (at
most ``COMPILES`` at once, ``COMPILE_BACKLOG`` waiting; one more is a 429), never on the threads
that check requests: a request without a constraint is not held behind one that compiles. Each new
constraint is compiled first in a process of its own (``grammar_check``) within the compile budget,
where a crash or a runaway costs that request alone, then in the server against the tokenizer, and
cached (``Compiler``).
"""
from __future__ import annotations

import json
import logging
import queue
import signal
import subprocess
import sys
import threading
from collections import OrderedDict
from concurrent.futures import Future

from dsv41.checkpoint.chat import VARIANTS
from dsv41.engine.grammar import Grammar, GrammarError, TokenTable
from dsv41.serving import constraint_bounds, grammar_check
from dsv41.serving.grammar_check import JSON_OPTIONS

CACHED = 256                      # compiled constraints kept (least recently used dropped)
COMPILES = 2                      # constraints compiled at once (each holds a core while it compiles)
COMPILE_BACKLOG = 64              # constraints waiting for those; one more is refused (429)
COMPILE_BUDGET_S = 10.0           # default of serve's --grammar-compile-timeout
# a compile thread's stack: llguidance recurses on it, and the grammar it compiles has compiled in
# grammar_check's process on a main thread's stack (8 MiB by default), so 8x that is margin
COMPILE_STACK_BYTES = 64 << 20

log = logging.getLogger(__name__)
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
OUTPUTS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar", "json_object": "json"}


class Refused(ValueError):
    """A constraint field this server cannot serve: (field, message)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


class Busy(Exception):
    """COMPILE_BACKLOG constraints are waiting to be compiled already."""


class Compiler:
    """Grammars over one tokenizer at the model's vocabulary width, compiled once per constraint, on
    COMPILES threads of its own (``submit``); budget_s: how long one may take to compile."""

    def __init__(self, codec, vocab: int, budget_s: float = COMPILE_BUDGET_S):
        self.codec, self.vocab, self.budget_s = codec, vocab, budget_s
        self._table: TokenTable | None = None
        self.cache: OrderedDict[tuple, Grammar] = OrderedDict()
        self.lock = threading.Lock()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.pending = 0                  # submitted and not yet done
        before = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            self.threads = [threading.Thread(target=self._work, name=f"dsv41-compile-{i}", daemon=True)
                            for i in range(COMPILES)]
            for t in self.threads:
                t.start()
        finally:
            threading.stack_size(before)

    def submit(self, fn, *args) -> Future:
        """fn(*args) on a compile thread; raises Busy when COMPILE_BACKLOG wait already."""
        with self.lock:
            if self.pending >= COMPILES + COMPILE_BACKLOG:
                raise Busy(f"{self.pending} constraints are being compiled or waiting to be; retry later")
            self.pending += 1
        future: Future = Future()
        self.jobs.put((future, fn, args))
        return future

    def _work(self):
        while (job := self.jobs.get()) is not None:
            future, fn, args = job
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args))
                    except BaseException as e:      # pyo3's PanicException is a BaseException
                        future.set_exception(e)
            finally:
                with self.lock:
                    self.pending -= 1

    def close(self):
        for _ in self.threads:
            self.jobs.put(None)

    def cached(self, kind: str, text: str) -> bool:
        with self.lock:
            return (kind, text) in self.cache

    @property
    def table(self) -> TokenTable:
        with self.lock:
            if self._table is None:          # made on first use: a server that serves none pays nothing
                self._table = TokenTable(self.codec.tokenizer, self.vocab, self.codec.eos_id)
            return self._table

    def grammar(self, kind: str, text: str, field: str) -> Grammar:
        """kind: json (a JSON schema's text), regex, choice (a JSON list's text), grammar, lark."""
        key = (kind, text)
        with self.lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
        try:
            compiled = Grammar(self.table, self._checked(kind, text, field), field)
        except GrammarError as e:
            raise Refused(field, f"cannot be compiled: {str(e).strip()}") from None
        with self.lock:
            self.cache[key] = compiled
            while len(self.cache) > CACHED:
                self.cache.popitem(last=False)
        return compiled


    def _checked(self, kind: str, text: str, field: str) -> str:
        """llguidance's grammar of the constraint, compiled once in a process of its own within the
        budget (``grammar_check``); refused when it does not compile there, in time or at all."""
        try:
            done = subprocess.run([sys.executable, "-I", grammar_check.__file__, kind], input=text, text=True,
                                  capture_output=True, timeout=self.budget_s)
        except subprocess.TimeoutExpired:
            raise Refused(field, f"not compiled within the compile budget of {self.budget_s:g} s "
                                 "(--grammar-compile-timeout); simplify it") from None
        if done.returncode != 0:
            how = signal.Signals(-done.returncode).name if done.returncode < 0 else f"status {done.returncode}"
            log.warning("%s: the grammar compiler's process ended (%s) on a %d-byte %s constraint",
                        field, how, len(text), kind)
            raise Refused(field, f"cannot be compiled: the grammar compiler failed on it ({how}); simplify it")
        out = json.loads(done.stdout)
        if "error" in out:
            raise Refused(field, f"cannot be compiled: {out['error'].strip()}")
        return out["spec"]


def bounded(field: str, kind: str, text: str) -> tuple[str, str, str]:
    """The constraint (field, kind, text) within ``constraint_bounds``' size and depth."""
    try:
        constraint_bounds.check(kind, text)
    except constraint_bounds.TooLarge as e:
        raise Refused(field, str(e)) from None
    return field, kind, text


def _schema_text(value, field: str) -> str:
    if isinstance(value, str):
        try:
            constraint_bounds.within(constraint_bounds.text_depth(value))   # before json.loads, which recurses
        except constraint_bounds.TooLarge as e:
            raise Refused(field, str(e)) from None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise Refused(field, f"expected a JSON schema, found text that is not JSON: {e}") from None
    if not isinstance(value, (dict, bool)):
        raise Refused(field, f"expected a JSON schema (an object), found {type(value).__name__}")
    return json.dumps(value, sort_keys=True)


def _choices(value, field: str) -> str:
    if not (isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)):
        raise Refused(field, "expected a non-empty list of non-empty strings")
    return json.dumps(value)


def _text(value, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise Refused(field, "expected a non-empty string")
    return value


def _response_format(fmt) -> tuple[str, str] | None:
    if not isinstance(fmt, dict):
        raise Refused("response_format", f"expected an object, found {type(fmt).__name__}")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json", json.dumps({"type": "object"})
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise Refused("response_format", "json_schema needs {\"name\": ..., \"schema\": {...}}")
        return "json", _schema_text(spec["schema"], "response_format.json_schema.schema")
    raise Refused("response_format", f"expected type \"text\", \"json_object\" or \"json_schema\", found {kind!r}")


def _structured_outputs(value) -> tuple[str, str, str]:
    if not isinstance(value, dict):
        raise Refused("structured_outputs", f"expected an object, found {type(value).__name__}")
    given = [k for k, v in value.items() if v is not None and v is not False]
    unknown = [k for k in given if k not in OUTPUTS]
    if unknown:
        raise Refused("structured_outputs", f"expected one of {', '.join(OUTPUTS)}, found {unknown[0]!r}")
    if len(given) != 1:
        raise Refused("structured_outputs", f"expected one constraint, found {len(given)}")
    name = given[0]
    field = f"structured_outputs.{name}"
    return (field, *_guided(name, value[name], field))


def _guided(name: str, value, field: str) -> tuple[str, str]:
    if name in ("guided_json", "json"):
        return "json", _schema_text(value, field)
    if name == "json_object":
        if value is not True:
            raise Refused(field, "expected true")
        return "json", json.dumps({"type": "object"})
    if name in ("guided_regex", "regex"):
        return "regex", _text(value, field)
    if name in ("guided_choice", "choice"):
        return "choice", _choices(value, field)
    return "grammar", _text(value, field)


def requested(body: dict) -> tuple[str, str, str] | None:
    """(field, kind, text) of the body's one constraint besides tool_choice, None without one."""
    found = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            found.append(("response_format", *spec))
    for name in GUIDED:
        if body.get(name) is not None:
            found.append((name, *_guided(name, body[name], name)))
    if body.get("structured_outputs") is not None:
        found.append(_structured_outputs(body["structured_outputs"]))
    if len(found) > 1:
        raise Refused(found[1][0], f"one constraint a request, and {found[0][0]} is given too")
    return found[0] if found else None


# ---- tool calls --------------------------------------------------------------------------------------------

def _parameter(variant, dsml: str, name: str, schema: dict) -> str:
    """One DSML parameter line (Lark): a string's text as it is (its enum or pattern kept; free
    text without "<": a lexeme that could take the closing tag's "<" would run past it), any other
    value as JSON its schema constrains."""
    def tag(is_string: str) -> str:
        return f"\"<\" {dsml} \"{variant.parameter} name=\\\"{json.dumps(name)[1:-1]}\\\" string=\\\"{is_string}\\\">\""
    close = f"\"</\" {dsml} \"{variant.parameter}>\\n\""
    if isinstance(schema, dict) and schema.get("type") == "string" and not schema.get("format"):
        if isinstance(schema.get("enum"), list) and all(isinstance(e, str) for e in schema["enum"]):
            value = "(" + " | ".join(json.dumps(e, ensure_ascii=False) for e in schema["enum"]) + ")"
        elif isinstance(schema.get("pattern"), str):    # matched whole: a subset of what the search allows
            value = "/" + schema["pattern"].replace("/", "\\/") + "/"
        else:
            low, high = schema.get("minLength", 0), schema.get("maxLength")
            value = f"/[^<]{{{low},{'' if high is None else high}}}/"   # "<" begins the closing tag
        return f"{tag('true')} {value} {close}"
    sub = {**schema, "x-guidance": JSON_OPTIONS} if isinstance(schema, dict) else {"x-guidance": JSON_OPTIONS}
    return f"{tag('false')} %json {json.dumps(sub)} {close}"


def _parameters(params, where: str) -> dict:
    """A function's parameters held to what the call's grammar reads of them, as a response_format
    schema is held to its type (a 400 naming the field, never a failure of the server's own): an
    object schema (or none), its properties schemas, its required a list of their names, a string
    property's length bounds non-negative integers, its enum a list and its pattern a string (the
    rest of each schema llguidance compiles, and refuses with its message)."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise Refused(where, f"expected a JSON schema (an object), found {_shown(params)}")
    props = params.get("properties", {})
    if not isinstance(props, dict):
        raise Refused(f"{where}.properties", f"expected an object of property schemas, found {_shown(props)}")
    required = params.get("required", [])
    if not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise Refused(f"{where}.required", f"expected a list of property names, found {_shown(required)}")
    for name, schema in props.items():
        at = f"{where}.properties.{name}"
        if not isinstance(schema, (dict, bool)):
            raise Refused(at, f"expected a JSON schema (an object), found {_shown(schema)}")
        if not isinstance(schema, dict):
            continue
        for key in ("minLength", "maxLength"):
            value = schema.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise Refused(f"{at}.{key}", f"expected a non-negative integer, found {_shown(value)}")
        if "maxLength" in schema and schema["maxLength"] < schema.get("minLength", 0):
            raise Refused(f"{at}.maxLength", f"{schema['maxLength']} is below minLength {schema['minLength']}")
        for key, kind in (("enum", list), ("pattern", str)):
            if key in schema and not isinstance(schema[key], kind):
                raise Refused(f"{at}.{key}", f"expected a {kind.__name__}, found {_shown(schema[key])}")
    return params


def _shown(value) -> str:
    """A refused value: a number, true/false/null as written, anything longer by its type alone."""
    return json.dumps(value) if value is None or isinstance(value, (bool, int, float)) else type(value).__name__


def tool_grammar(tools: list, choice, chat_format: str, dsml_id: int) -> tuple[str, str]:
    """(field, Lark text) of the DSML block ``tool_choice`` asks for: "required", at least one
    call of the offered tools; a named function, exactly one call of it. dsml_id: the DSML
    control token (a Lark grammar names a special token by its id)."""
    dsml = f"<[{dsml_id}]>"
    if chat_format not in VARIANTS:
        raise Refused("tool_choice", f"forcing a call needs the DeepSeek tool-call format; the {chat_format} "
                                     "chat format has none")
    variant = VARIANTS[chat_format]
    functions = {}
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            functions[fn["name"]] = _parameters(fn.get("parameters"), f"tools[{i}].function.parameters")
    if not functions:
        raise Refused("tool_choice", "forcing a call needs tools")
    if choice != "required":
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if name not in functions:
            raise Refused("tool_choice", f"expected \"none\", \"auto\", \"required\" or a function of tools, "
                                         f"found {choice!r}")
        functions = {name: functions[name]}
    rules, invokes = [], []
    for i, (name, params) in enumerate(functions.items()):
        props = params.get("properties") or {}
        need = set(params.get("required") or [])
        parts = []
        for j, (pname, pschema) in enumerate(props.items()):
            rules.append(f"p{i}_{j}: {_parameter(variant, dsml, pname, pschema)}")
            parts.append(f"p{i}_{j}" + ("" if pname in need else "?"))
        invoke = f"\"<\" {dsml} \"{variant.invoke} name=\\\"{json.dumps(name)[1:-1]}\\\">\\n\" " + \
                 " ".join(parts) + f" \"</\" {dsml} \"{variant.invoke}>\\n\""
        rules.append(f"invoke{i}: {invoke}")
        invokes.append(f"invoke{i}")
    calls = "(" + " | ".join(invokes) + ")" + ("+" if choice == "required" else "")
    start = f"start: \"<\" {dsml} \"{variant.calls}>\\n\" {calls} \"</\" {dsml} \"{variant.calls}>\""
    return "tool_choice", "\n".join([start, *rules])
