"""ctypes mirrors of the C API's structs, read from the headers themselves
(csrc/kernels/include/fastffn/*.h), and the check of every mirror against the layout table the
library exports (fastffn_abi_* in c_api.h): c_api.py runs it when it loads the library, the CPU
build check against a g++ build of the host code. No torch: the Paddle tests of the C entry
points' statuses import these too.

A struct added to a header gets its mirror here with no edit: `MIRRORS` maps every C typedef to its
ctypes type, and each struct is also this module's attribute under its C name in CamelCase
(fastffn_rms_norm_args -> RmsNormArgs). The headers' struct declarations stay plain for that:
one field per line, `type name;` with an optional `// comment`, the types below or another
fastffn_* struct. What the parser makes of them is checked against the compiler's layouts
(check_abi), so a declaration it misreads fails on load instead of shifting arguments.
"""

from __future__ import annotations

import ctypes
import re

from paddle_fastffn.torch.build import definition

# C field types -> ctypes; any pointer is c_void_p (the bindings pass addresses as integers).
_SCALARS = {"int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
            "float": ctypes.c_float}
_TYPEDEF = re.compile(r"typedef\s+(struct|enum)\s*\{(.*?)\}\s*(fastffn_\w+)\s*;", re.S)
_FIELD = re.compile(r"^(?:const\s+)?(\w+)\s*(\*?)\s*(\w+)\s*;$")


def _camel(c_name: str) -> str:
    return "".join(part.title() for part in c_name[len("fastffn_"):].split("_"))


def _field_type(c_type: str, pointer: str, mirrors: dict):
    if pointer:
        return ctypes.c_void_p
    if c_type in _SCALARS:
        return _SCALARS[c_type]
    if c_type in mirrors:  # an enum (c_int) or a struct declared before this one
        return mirrors[c_type]
    raise ValueError(f"c_structs: no ctypes mirror for the C type {c_type!r}")


def parse_headers(texts: list[str]) -> dict:
    """{C typedef name: its ctypes mirror} for every `typedef enum {...} fastffn_x;` (c_int: an
    enum is passed as int) and `typedef struct {...} fastffn_x;` of the headers, in order."""
    mirrors: dict = {}
    for text in texts:
        for kind, body, name in _TYPEDEF.findall(text):
            if kind == "enum":
                mirrors[name] = ctypes.c_int
                continue
            fields = []
            for line in body.splitlines():
                line = line.split("//")[0].strip()
                if not line:
                    continue
                match = _FIELD.match(line)
                if match is None:
                    raise ValueError(f"c_structs: {name}: cannot read the field declaration {line!r} "
                                     f"(one `type name;` per line)")
                c_type, pointer, field = match.groups()
                fields.append((field, _field_type(c_type, pointer, mirrors)))
            mirrors[name] = type(_camel(name), (ctypes.Structure,), {"_fields_": fields, "__doc__": name})
    return mirrors


def _headers() -> list[str]:
    folder = definition.include_dirs()[0] / "fastffn"
    return [path.read_text() for path in sorted(folder.glob("*.h"))]


def header_constant(name: str) -> int:
    """The integer a header #defines as `name` (read, not copied, so the two cannot drift)."""
    for text in _headers():
        match = re.search(rf"^#define {re.escape(name)} (\d+)\s*$", text, re.M)
        if match:
            return int(match.group(1))
    raise KeyError(f"no `#define {name} <integer>` in the C API headers")


# C type name -> its mirror; enums are passed as ctypes.c_int.
MIRRORS = parse_headers(_headers())
globals().update({_camel(name): mirror for name, mirror in MIRRORS.items() if mirror is not ctypes.c_int})


class AbiMismatch(RuntimeError):
    """A ctypes mirror disagrees with the loaded library's struct layout."""


def library_layouts(lib: ctypes.CDLL) -> dict[str, tuple[int, list[tuple[str, int]]]]:
    """{C type name: (sizeof, [(field, byte offset), ...])} from the library's fastffn_abi_* table."""
    lib.fastffn_abi_struct_count.restype = ctypes.c_int
    lib.fastffn_abi_struct_name.restype = ctypes.c_char_p
    lib.fastffn_abi_struct_name.argtypes = [ctypes.c_int]
    lib.fastffn_abi_struct_size.restype = ctypes.c_int64
    lib.fastffn_abi_struct_size.argtypes = [ctypes.c_int]
    lib.fastffn_abi_field_count.restype = ctypes.c_int
    lib.fastffn_abi_field_count.argtypes = [ctypes.c_int]
    lib.fastffn_abi_field_name.restype = ctypes.c_char_p
    lib.fastffn_abi_field_name.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.fastffn_abi_field_offset.restype = ctypes.c_int64
    lib.fastffn_abi_field_offset.argtypes = [ctypes.c_int, ctypes.c_int]
    layouts = {}
    for i in range(lib.fastffn_abi_struct_count()):
        fields = [(lib.fastffn_abi_field_name(i, j).decode(), lib.fastffn_abi_field_offset(i, j))
                  for j in range(lib.fastffn_abi_field_count(i))]
        layouts[lib.fastffn_abi_struct_name(i).decode()] = (lib.fastffn_abi_struct_size(i), fields)
    return layouts


def check_abi(lib: ctypes.CDLL, mirrors: dict | None = None) -> None:
    """Raises AbiMismatch naming the struct (and field) where a mirror and the library differ:
    a C struct without a mirror or the reverse, sizeof, the field names in order, or an offset."""
    mirrors = MIRRORS if mirrors is None else mirrors
    layouts = library_layouts(lib)
    for name in sorted(set(layouts) ^ set(mirrors)):
        where = "the library exports it but paddle_fastffn/torch/c_structs.py has no mirror" \
            if name in layouts else "c_structs.py mirrors it but the library does not export it"
        raise AbiMismatch(f"{name}: {where}")
    for name, (size, fields) in layouts.items():
        mirror = mirrors[name]
        if ctypes.sizeof(mirror) != size:
            raise AbiMismatch(f"{name}: sizeof is {size} bytes in the library, "
                              f"{ctypes.sizeof(mirror)} in its ctypes mirror {mirror.__name__}")
        if not fields:
            continue
        mirrored = [field[0] for field in mirror._fields_]
        if mirrored != [field for field, _ in fields]:
            raise AbiMismatch(f"{name}: fields are {[f for f, _ in fields]} in the library, "
                              f"{mirrored} in its ctypes mirror {mirror.__name__}")
        for field, offset in fields:
            if getattr(mirror, field).offset != offset:
                raise AbiMismatch(f"{name}.{field}: offset {offset} in the library, "
                                  f"{getattr(mirror, field).offset} in {mirror.__name__}")
