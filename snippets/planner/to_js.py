"""Translate snippets/planner/cost_model.py into JavaScript for the calculator page.

One source of truth: the browser runs the very model the tests check against the course's
measurements, translated statement by statement. The translator knows only the small subset of
Python the cost model is written in, and refuses anything else with the line number, so a change
to the model that JavaScript could not mirror fails the site build instead of drifting.

    python -m snippets.planner.to_js > /tmp/planner-model.js
"""

import ast
import json
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("cost_model.py")

BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Mod: "%", ast.Pow: "**"}
COMPARE = {ast.Eq: "===", ast.NotEq: "!==", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">",
           ast.GtE: ">="}
CALLS = {"max": "Math.max", "min": "Math.min", "math.ceil": "Math.ceil",
         "math.floor": "Math.floor", "math.sqrt": "Math.sqrt"}


class Unsupported(ValueError):
    pass


def refuse(node, what):
    raise Unsupported(f"cost_model.py line {node.lineno}: {what} has no translation to "
                      f"JavaScript; keep the cost model to the subset in snippets/planner/to_js.py")


def expr(node) -> str:
    match node:
        case ast.Constant(value=bool() as v):
            return "true" if v else "false"
        case ast.Constant(value=None):
            return "null"
        case ast.Constant(value=int() | float() | str() as v):
            return json.dumps(v)
        case ast.Name(id=name):
            return name
        case ast.BinOp(left=left, op=ast.FloorDiv(), right=right):
            return f"Math.floor({expr(left)} / {expr(right)})"
        case ast.BinOp(left=left, op=op, right=right) if type(op) in BINARY:
            return f"({expr(left)} {BINARY[type(op)]} {expr(right)})"
        case ast.UnaryOp(op=ast.USub(), operand=operand):
            return f"(-{expr(operand)})"
        case ast.UnaryOp(op=ast.Not(), operand=operand):
            return f"(!{expr(operand)})"
        case ast.BoolOp(op=op, values=values):
            joiner = " && " if isinstance(op, ast.And) else " || "
            return "(" + joiner.join(expr(v) for v in values) + ")"
        case ast.Compare(left=left, ops=[op], comparators=[right]):
            if isinstance(op, (ast.In, ast.NotIn)):
                if isinstance(right, (ast.Tuple, ast.List)):
                    test = f"{expr(right)}.includes({expr(left)})"
                else:  # a name: a tuple (an array in JavaScript) or a dict
                    r, item = expr(right), expr(left)
                    test = f"(Array.isArray({r}) ? {r}.includes({item}) : ({item} in {r}))"
                return f"(!{test})" if isinstance(op, ast.NotIn) else test
            if type(op) in COMPARE:
                return f"({expr(left)} {COMPARE[type(op)]} {expr(right)})"
            refuse(node, "this comparison")
        case ast.IfExp(test=test, body=body, orelse=orelse):
            return f"({expr(test)} ? {expr(body)} : {expr(orelse)})"
        case ast.Subscript(value=value, slice=key):
            return f"{expr(value)}[{expr(key)}]"
        case ast.Dict(keys=keys, values=values) if all(isinstance(k, ast.Constant) for k in keys):
            items = ", ".join(f"{json.dumps(k.value)}: {expr(v)}" for k, v in zip(keys, values))
            return "{" + items + "}"
        case ast.Tuple(elts=elts) | ast.List(elts=elts):
            return "[" + ", ".join(expr(e) for e in elts) + "]"
        case ast.Call(func=func, args=args, keywords=[]):
            name = ast.unparse(func)
            return f"{CALLS.get(name, name)}(" + ", ".join(expr(a) for a in args) + ")"
        case ast.JoinedStr(values=values):
            parts = []
            for v in values:
                if isinstance(v, ast.Constant):
                    parts.append(v.value.replace("\\", "\\\\").replace("`", "\\`")
                                 .replace("${", "\\${"))
                elif isinstance(v, ast.FormattedValue) and v.format_spec is None:
                    parts.append("${" + expr(v.value) + "}")
                else:
                    refuse(node, "a format specification in an f-string")
            return "`" + "".join(parts) + "`"
    refuse(node, type(node).__name__)


def assigned_names(body) -> list[str]:
    names = []
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        targets = node.targets if isinstance(node, ast.Assign) else []
        for target in targets:
            for name in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(name, ast.Name) and name.id not in names:
                    names.append(name.id)
    return names


def statements(body, indent: str) -> list[str]:
    out = []
    for node in body:
        match node:
            case ast.Expr(value=ast.Constant(value=str())):
                continue  # a docstring
            case ast.Assign(targets=[ast.Name(id=name)], value=value):
                out.append(f"{indent}{name} = {expr(value)};")
            case ast.Assign(targets=[ast.Tuple(elts=names)], value=ast.Tuple(elts=values)) \
                    if len(names) == len(values):
                for name, value in zip(names, values):
                    out.append(f"{indent}{expr(name)} = {expr(value)};")
            case ast.Expr(value=ast.Call() as call):
                out.append(f"{indent}{expr(call)};")
            case ast.Return(value=value):
                out.append(f"{indent}return {expr(value)};")
            case ast.If(test=test, body=then, orelse=orelse):
                out.append(f"{indent}if ({expr(test)}) {{")
                out += statements(then, indent + "  ")
                if orelse:
                    out.append(f"{indent}}} else {{")
                    out += statements(orelse, indent + "  ")
                out.append(f"{indent}}}")
            case ast.For(target=ast.Name(id=name), iter=ast.Tuple() | ast.List() as items,
                         body=loop, orelse=[]):
                out.append(f"{indent}for (const {name} of {expr(items)}) {{")
                out += statements(loop, indent + "  ")
                out.append(f"{indent}}}")
            case ast.Raise(exc=ast.Call(func=ast.Name(id="PlannerError"), args=[message])):
                out.append(f"{indent}throw new PlannerError({expr(message)});")
            case _:
                refuse(node, type(node).__name__)
    return out


def translate(source: str) -> str:
    tree = ast.parse(source)
    lines = ["// Generated from snippets/planner/cost_model.py by snippets/planner/to_js.py.",
             "// Do not edit: change the Python and rebuild the site.",
             "(function () {",
             '"use strict";',
             "class PlannerError extends Error {}"]
    exported = ["PlannerError"]
    for node in tree.body:
        match node:
            case ast.Expr(value=ast.Constant(value=str())) | ast.Import(names=[ast.alias("math")]):
                continue
            case ast.ClassDef(name="PlannerError"):
                continue
            case ast.Assign(targets=[ast.Name(id=name)], value=value):
                lines.append(f"const {name} = {expr(value)};")
                exported.append(name)
            case ast.FunctionDef(name=name, args=args, body=body) if not (
                    args.vararg or args.kwarg or args.kwonlyargs or args.defaults):
                params = [a.arg for a in args.args]
                lines.append(f"function {name}({', '.join(params)}) {{")
                local = [n for n in assigned_names(body) if n not in params]
                if local:
                    lines.append(f"  let {', '.join(local)};")
                lines += statements(body, "  ")
                lines.append("}")
                exported.append(name)
            case _:
                refuse(node, type(node).__name__)
    lines.append(f"window.PlannerModel = {{{', '.join(exported)}}};")
    lines.append("})();")
    return "\n".join(lines) + "\n"


def main() -> None:
    sys.stdout.write(translate(SOURCE.read_text()))


if __name__ == "__main__":
    main()
