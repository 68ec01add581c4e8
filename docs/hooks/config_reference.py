"""MkDocs hook: the configuration reference, generated from the config types at build time.

A page that holds a marker line

    <!-- config-reference: proxy.config:RouterConfig -->

gets, in its place, one table per settings type reachable from that type (`module:Type`,
a msgspec Struct): each field's key, type, default and description. The descriptions are
the comments the source puts on a field (the lines right above it and the one at its end),
and a section's text is its type's docstring, so the reference says what the code says:
nothing is written twice. `tests/unit/test_config_reference.py` checks that every field is
in it, with a description.
"""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
import io
import re
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- config-reference: ([\w.]+):(\w+)(?: as (\w+))? -->$", re.MULTILINE)


@dataclass
class Field:
    """One setting: where it is, what it takes and what the source says of it."""

    key: str
    type: str
    default: str
    description: str


@dataclass
class Section:
    """One settings type, at the key it is found under ("" for the root)."""

    key: str
    type_name: str
    doc: str
    fields: list[Field] = field(default_factory=list)


def _comments(source: str) -> dict[int, str]:
    """Every comment in the source, by line number, without its `#`."""
    found: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found[token.start[0]] = token.string.lstrip("#").strip()
    return found


def _class_nodes(source: str) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)}


@dataclass
class _Source:
    """A module's source, read once: its classes' syntax and its comments."""

    module: Any
    lines: list[str]
    classes: dict[str, ast.ClassDef]
    comments: dict[int, str]

    @classmethod
    def of(cls, module: Any) -> _Source:
        # A module compiled with the request path (`proxy.choices`) is a C extension
        # beside its source: the source is read.
        path = Path(inspect.getfile(module))
        if path.suffix != ".py":
            path = path.with_name(module.__name__.rpartition(".")[2] + ".py")
        text = path.read_text()
        return cls(module, text.splitlines(), _class_nodes(text), _comments(text))

    def described(self, node: ast.stmt) -> str:
        """The comment lines right above a statement, then the one at its end."""
        above: list[str] = []
        line = node.lineno - 1
        while line >= 1 and self.lines[line - 1].strip().startswith("#"):
            above.insert(0, self.comments.get(line, ""))
            line -= 1
        trailing = self.comments.get(node.end_lineno or node.lineno)
        if trailing is not None and not self.lines[(node.end_lineno or node.lineno) - 1] \
                .strip().startswith("#"):
            above.append(trailing)
        return _join(above)

    def field_nodes(self, class_name: str) -> dict[str, ast.AnnAssign]:
        node = self.classes.get(class_name)
        if node is None:
            return {}
        return {
            statement.target.id: statement
            for statement in node.body
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
        }

    def enum_members(self, class_name: str) -> dict[str, str]:
        """An enum's members' comments, by member name."""
        node = self.classes.get(class_name)
        if node is None:
            return {}
        return {
            statement.targets[0].id: self.described(statement)
            for statement in node.body
            if isinstance(statement, ast.Assign) and isinstance(statement.targets[0], ast.Name)
        }


def _join(lines: list[str]) -> str:
    """Comment lines as one paragraph; a line starting with "- " starts a list item."""
    text = ""
    for line in lines:
        if not line:
            continue
        if line.startswith("- "):
            text += "<br>" + line
        else:
            text += (" " if text else "") + line
    return text.strip()


def _doc(cls: type) -> str:
    return inspect.cleandoc(cls.__dict__.get("__doc__") or "")


def _format(value: Any) -> str:
    """A default as a config file writes it."""
    if isinstance(value, enum.Enum):
        return f"`{value.value}`"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, list):
        return "`[" + ", ".join(
            str(item.value) if isinstance(item, enum.Enum) else repr(item) for item in value
        ) + "]`"
    if isinstance(value, msgspec.Struct):
        return "see below"
    return f"`{value!r}`"


def _default(info: msgspec.structs.FieldInfo, node: ast.AnnAssign | None) -> str:
    if info.default is not msgspec.NODEFAULT:
        value = info.default
    elif info.default_factory is not msgspec.NODEFAULT:
        value = info.default_factory()
    else:
        return "required"
    shown = _format(value)
    expression = ast.unparse(node.value) if node is not None and node.value is not None else ""
    literal = isinstance(node.value, ast.Constant) if node is not None else True
    if expression and not literal and isinstance(value, int | float) \
            and not isinstance(value, bool) and expression != repr(value):
        shown += f" (`{expression}`)"
    return shown


def _struct_types(annotation: Any) -> list[type]:
    """The settings types a field's type holds (`X`, `X | None`, `list[X]`)."""
    found: list[type] = []
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return [annotation]
    for argument in getattr(annotation, "__args__", ()):
        found.extend(_struct_types(argument))
    return found


def _enum_types(annotation: Any) -> list[type[enum.Enum]]:
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [annotation]
    found: list[type[enum.Enum]] = []
    for argument in getattr(annotation, "__args__", ()):
        found.extend(_enum_types(argument))
    return found


def _literal_values(annotation: Any) -> list[Any]:
    origin = getattr(annotation, "__origin__", None)
    if origin is not None and str(origin) == "typing.Literal":
        return list(annotation.__args__)
    if str(type(annotation)) == "<class 'typing._LiteralGenericAlias'>":
        return list(annotation.__args__)
    return []


def _mentions(text: str, name: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", text) is not None


def _inherited(name: str, group: list[tuple[str, str]], doc: str, structs: list[type]) -> str:
    """A field with no comment of its own: the comment of a field above it in its group
    that names it, else its section's text when that names it, else its type's."""
    for other, text in reversed(group):
        if text and _mentions(text, name):
            return f"See `{other}`."
    if doc and _mentions(doc, name):
        return "See the section's text."
    for struct in structs:
        first = _doc(struct).split("\n\n")[0].replace("\n", " ")
        if first:
            return first
    return ""


def sections(spec: str, type_name: str) -> list[Section]:
    """The reference of `module:Type`: one section per settings type, depth first."""
    module = importlib.import_module(spec)
    root = getattr(module, type_name)
    sources: dict[str, _Source] = {}
    result: list[Section] = []

    def source_of(cls: type) -> _Source:
        name = cls.__module__
        if name not in sources:
            sources[name] = _Source.of(importlib.import_module(name))
        return sources[name]

    seen: dict[type, Section] = {}

    def visit(cls: type, key: str) -> None:
        if cls in seen:  # one type under several keys (prefill[] and decode[]): one section
            seen[cls].key += f"`, `{key}"
            return
        source = source_of(cls)
        nodes = source.field_nodes(cls.__name__)
        section = Section(key, cls.__name__, _doc(cls))
        seen[cls] = section
        result.append(section)
        nested: list[tuple[type, str]] = []
        group: list[tuple[str, str]] = []  # the fields above, up to a blank line: (name, text)
        previous_end = 0
        for info in msgspec.structs.fields(cls):
            node = nodes.get(info.name)
            full = f"{key}.{info.name}" if key else info.name
            own = source.described(node) if node is not None else ""
            if node is not None and node.lineno - previous_end > 1 \
                    and not source.lines[node.lineno - 2].strip().startswith("#"):
                group = []  # a blank line or other code: a new group
            description = own or _inherited(info.name, group, section.doc,
                                            _struct_types(info.type))
            if node is not None:
                group.append((info.name, own))
                previous_end = node.end_lineno or node.lineno
            for kind in _enum_types(info.type):
                members = source_of(kind).enum_members(kind.__name__)
                choices = "; ".join(
                    f"`{member.value}`" + (f": {members[member.name]}"
                                           if members.get(member.name) else "")
                    for member in kind)
                description += ("<br>" if description else "") + f"One of {choices}."
            literals = _literal_values(info.type)
            if literals:
                description += ("<br>" if description else "") + "One of " + ", ".join(
                    f"`{value}`" for value in literals) + "."
            type_text = ast.unparse(node.annotation) if node is not None else str(info.type)
            default = _default(info, node)
            for struct in _struct_types(info.type):
                if struct is not cls:
                    suffix = "[]" if type_text.startswith("list[") else ""
                    earlier = [key for other, key in nested if other is struct]
                    at = (seen[struct].key.split("`")[0] if struct in seen
                          else earlier[0] if earlier else full + suffix)
                    nested.append((struct, full + suffix))
                    if default == "see below":
                        default = f"[see below](#{anchor(at)})"
                    else:
                        description += f" Its settings: [`{at}`](#{anchor(at)})."
            section.fields.append(Field(full, type_text, default, description))
        for struct, at in nested:
            visit(struct, at)

    visit(root, "")
    return result


def anchor(key: str) -> str:
    """The id of a section's heading: its key, `.` and `[]` made plain."""
    return re.sub(r"[^\w-]", "-", key.replace("[]", "")) or "top-level"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(spec: str, type_name: str, root: str | None = None) -> str:
    """The reference of `module:Type` as Markdown, its top level titled `root`."""
    out: list[str] = []
    for section in sections(spec, type_name):
        title = f"`{section.key}`" if section.key else (f"`{root}`" if root else "Top level")
        out.append(f"## {title} {{ #{anchor(section.key.split('`')[0])} }}\n")
        out.append(f"`{section.type_name}`, in `{spec.replace('.', '/')}.py`.")
        out.append("")
        if section.doc:
            out.append(section.doc)
            out.append("")
        out.append("| setting | type | default | what it does |")
        out.append("| --- | --- | --- | --- |")
        for item in section.fields:
            name = item.key.rsplit(".", 1)[-1]
            out.append(f"| `{name}` | `{_cell(item.type)}` | {_cell(item.default)} | "
                       f"{_cell(item.description)} |")
        out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """MkDocs' hook: replace every marker with its reference."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return MARKER.sub(lambda match: render(*match.groups()), markdown)
