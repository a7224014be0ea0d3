"""tools/import_graph.py (issue 31): the package's import graph has no cycle,
no module imports another's private names, no class or function is over
budget; and the check fails, naming the modules and lines, on a package
with a cycle (deferred import too), a private import or a long function."""

import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import import_graph  # noqa: E402


def _package(files):
    d = tempfile.mkdtemp()
    pkg = os.path.join(d, "pkg")
    os.makedirs(os.path.join(pkg, "sub"))
    for name, text in files.items():
        with open(os.path.join(pkg, name), "w") as f:
            f.write(text)
    return pkg


class ImportGraphTest(unittest.TestCase):
    def test_client_package_is_clean(self):
        findings = import_graph.check(os.path.join(ROOT, "client", "python", "weightsync"))
        self.assertEqual(findings, [])

    def test_cycle_found(self):
        pkg = _package({
            "__init__.py": "",
            "a.py": "from pkg import b\n",
            "b.py": "def f():\n    from pkg.sub import c\n",
            "sub/__init__.py": "",
            "sub/c.py": "import pkg.a as a\n",
            "d.py": "from pkg import a\n",      # reaches the cycle, not in it
        })
        findings = import_graph.check(pkg)
        self.assertEqual(len(findings), 1, findings)
        self.assertIn("import cycle among pkg.a, pkg.b, pkg.sub.c", findings[0])
        self.assertIn("pkg.b -> pkg.sub.c", findings[0])
        self.assertIn("b.py:2", findings[0])

    def test_private_names_found(self):
        pkg = _package({
            "__init__.py": "from pkg.a import thing\n",
            "_impl.py": "def public():\n    pass\n\n\ndef _hidden():\n    pass\n",
            "a.py": ("from pkg._impl import public\nfrom pkg import _impl\n"
                     "from pkg import _impl as other\nthing = 1\n"
                     "x = _impl._hidden\ny = other.__name__\n"),
            "b.py": "from pkg._impl import _hidden\n",
            "sub/__init__.py": "from .. import a\nz = a._private\n",
        })
        findings = sorted(import_graph.check(pkg))
        self.assertEqual(len(findings), 3, findings)
        self.assertIn("a.py:5: uses private name _hidden of pkg._impl", findings[0])
        self.assertIn("b.py:1: imports private name _hidden of pkg._impl", findings[1])
        self.assertIn("sub/__init__.py:2: uses private name _private of pkg.a", findings[2])

    def test_budgets(self):
        lines = [f"    x{i} = {i}\n" for i in range(80)]
        pkg = _package({"__init__.py": "", "a.py": "def short():\n" + "".join(lines[:79])
                        + "\n\ndef long():\n" + "".join(lines)})
        findings = import_graph.check(pkg)
        self.assertEqual(len(findings), 1, findings)
        self.assertIn("a.py:83: function long is 81 lines (budget 80)", findings[0])


if __name__ == "__main__":
    unittest.main()
