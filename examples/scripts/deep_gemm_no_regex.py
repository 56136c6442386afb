"""Replace DeepGEMM's three std::regex uses with plain string scans (the same matches) in a source tree.

    python3 examples/scripts/deep_gemm_no_regex.py DEEPGEMM_SOURCE_DIR

std::regex crashes inside a torch process on the H200 image (torch 2.11: a SIGSEGV in collate<char>::transform
while DeepGEMM's JIT IncludeParser compiles a bracket expression; torch's libraries and the system libstdc++ disagree
on the locale facets). build_deep_gemm.sh and benchmarks/deep_gemm_device.sh run this before building. Exits with
one line naming the file when the expected code is not there (another DeepGEMM version).
"""

from __future__ import annotations

import pathlib
import sys

__all__ = ["PATCHES", "patch"]

# (file under the source root, the code DeepGEMM has, what replaces it)
PATCHES = [
    ("csrc/jit/include_parser.hpp",
    """        const std::regex pattern(R"(#\\s*include\\s*[<"][^>"]+[>"])");
        std::sregex_iterator iter(code.begin(), code.end(), pattern);
        const std::sregex_iterator end;

        // TODO: parse relative paths as well
        for (; iter != end; ++ iter) {
            const auto include_str = iter->str();
""",
    """        // Matches of #\\s*include\\s*[<"][^>"]+[>"], found without std::regex
        std::vector<std::string> matches;
        const auto is_space = [](const char ch) { return ch == ' ' or ch == '\\t' or ch == '\\n' or ch == '\\r' or ch == '\\f' or ch == '\\v'; };
        for (size_t p = code.find('#'); p != std::string::npos; p = code.find('#', p)) {
            size_t q = p + 1;
            while (q < code.size() and is_space(code[q])) ++ q;
            if (code.compare(q, 7, "include") != 0) { ++ p; continue; }
            q += 7;
            while (q < code.size() and is_space(code[q])) ++ q;
            if (q >= code.size() or (code[q] != '<' and code[q] != '"')) { ++ p; continue; }
            size_t r = q + 1;
            while (r < code.size() and code[r] != '>' and code[r] != '"') ++ r;
            if (r >= code.size() or r == q + 1) { ++ p; continue; }
            matches.push_back(code.substr(p, r - p + 1));
            p = r + 1;
        }
        for (const auto& include_str: matches) {
"""),
    ("csrc/jit/compiler.hpp",
    """        std::smatch match;
        DG_HOST_ASSERT(std::regex_search(output, match, std::regex(R"(release (\\d+\\.\\d+))")));
        std::sscanf(match[1].str().c_str(), "%d.%d", &major, &minor);
""",
    """        const auto release_pos = output.find("release ");
        DG_HOST_ASSERT(release_pos != std::string::npos);
        DG_HOST_ASSERT(std::sscanf(output.c_str() + release_pos + 8, "%d.%d", &major, &minor) == 2);
"""),
    ("csrc/jit/compiler.hpp",
    """DG_HOST_ASSERT(not std::regex_search(output, std::regex(R"(Local memory used)")));""",
    """DG_HOST_ASSERT(output.find("Local memory used") == std::string::npos);"""),
]


def patch(src: pathlib.Path) -> None:
    for rel, old, new in PATCHES:
        f = src / rel
        text = f.read_text()
        if old not in text:
            raise SystemExit(f"deep_gemm_no_regex: {rel}: expected code not found (another DeepGEMM version?)")
        f.write_text(text.replace(old, new, 1))


if __name__ == "__main__":
    patch(pathlib.Path(sys.argv[1]))
