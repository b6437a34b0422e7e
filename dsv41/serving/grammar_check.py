"""A constraint made into llguidance's grammar and compiled once where a crash or a runaway costs
one request, not the server: run as a script (``python -I grammar_check.py KIND``, the constraint's
text on stdin) in a process of its own that imports llguidance alone, killed at the server's compile
budget (``structured.Compiler``). It prints one JSON line, ``{"spec": ...}`` (the grammar the server
then compiles in its own process against the tokenizer) or ``{"error": ...}`` (llguidance's
message).

Why a process: llguidance compiles a grammar by recursion on the calling thread's stack, and a
schema or rule chain some thousands deep overflows it (SIGSEGV, the process gone); and llguidance's
GBNF reader is Python whose time grows with the square of the grammar (a 97 KB one took 67 s on
the test machine). The depth and size bounds (``constraint_bounds``) refuse both before they get
here; this is what holds when something passes them that they did not foresee. The server compiles
the grammar again only after it compiled here, on threads with a larger stack than this process's
main thread.
"""
import json
import sys

JSON_OPTIONS = {"whitespace_flexible": False}     # JSON written compact (serving.structured)


def spec(kind: str, text: str) -> str:
    """llguidance's grammar of a constraint: kind json (a JSON schema's text), regex, choice (a JSON
    list's text), grammar (Lark or GBNF), lark. Raises ValueError for text it cannot read."""
    import llguidance
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
    return llguidance.grammar_from(kind, text)


def check(kind: str, text: str) -> dict:
    import llguidance
    try:
        grammar = spec(kind, text)
    except ValueError as e:
        return {"error": str(e)}
    error = llguidance.LLMatcher.validate_grammar(grammar)
    return {"error": error} if error else {"spec": grammar}


if __name__ == "__main__":
    print(json.dumps(check(sys.argv[1], sys.stdin.read())))
