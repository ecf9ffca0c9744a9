"""dualkv.precompile fills the kernel cache ahead of time: with an explicit
arch it needs neither a GPU nor torch, and a later process finds every kernel
on disk (no compile). Needs the library ($DUALKV_LIB) and ptxas is optional."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
import dualkv  # noqa: E402

CHILD = """
import json, sys
sys.path.insert(0, {path!r})
import dualkv
print(json.dumps(dualkv.precompile(head_dim=64, num_q_heads=4, num_kv_heads=2,
                                   dtype="bf16", arch="sm_80",
                                   backward={backward})))
"""


def run_child(cache, backward):
    env = dict(os.environ, DUALKV_CACHE_DIR=cache)
    env.pop("DUALKV_ALWAYS_COMPILE", None)
    env["DUALKV_TUNING_DB"] = os.path.join(cache, "none.json")
    code = CHILD.format(path=os.path.join(HERE, ".."), backward=backward)
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


class PrecompileTest(unittest.TestCase):
    def test_second_process_reads_everything_from_disk(self):
        with tempfile.TemporaryDirectory() as tmp:
            cache = os.path.join(tmp, "cache")
            first = run_child(cache, backward=False)
            self.assertEqual(first["kernels"], 1)
            self.assertEqual(first["compiles"] + first["disk_hits"], 1)
            self.assertTrue(os.path.isdir(os.path.join(cache, "v3", "sm_80")))
            second = run_child(cache, backward=False)
            self.assertEqual(second["kernels"], 1)
            self.assertEqual(second["compiles"], 0)
            self.assertEqual(second["disk_hits"], 1)

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "head_dim"):
            dualkv.precompile(head_dim=80, num_q_heads=4, num_kv_heads=2,
                              arch="sm_80")
        with self.assertRaisesRegex(ValueError, "multiple"):
            dualkv.precompile(head_dim=64, num_q_heads=3, num_kv_heads=2,
                              arch="sm_80")
        with self.assertRaisesRegex(ValueError, "arch"):
            dualkv.precompile(head_dim=64, num_q_heads=4, num_kv_heads=2,
                              arch="sm_75")
        with self.assertRaisesRegex(ValueError, "dtype"):
            dualkv.precompile(head_dim=64, num_q_heads=4, num_kv_heads=2,
                              dtype="fp32", arch="sm_80")
        with self.assertRaisesRegex(ValueError, "num_q_heads"):
            dualkv.precompile(head_dim=64, num_q_heads=True, num_kv_heads=2,
                              arch="sm_80")
        with self.assertRaisesRegex(ValueError, "window"):
            dualkv.precompile(head_dim=64, num_q_heads=4, num_kv_heads=2,
                              arch="sm_80", window=-1)
        with self.assertRaisesRegex(ValueError, "softcap"):
            dualkv.precompile(head_dim=64, num_q_heads=4, num_kv_heads=2,
                              arch="sm_80", softcap=-2.0)
        # MLA's query/key head_dim needs its value head_dim, which goes
        # with nothing else; both are integers.
        with self.assertRaisesRegex(ValueError, r"head_dim \(192\) with "
                                    r"v_head_dim \(0: head_dim\)"):
            dualkv.precompile(head_dim=192, num_q_heads=4, num_kv_heads=2,
                              arch="sm_80")
        with self.assertRaisesRegex(ValueError, r"head_dim \(128\) with "
                                    r"v_head_dim \(64\)"):
            dualkv.precompile(head_dim=128, num_q_heads=4, num_kv_heads=2,
                              arch="sm_80", v_head_dim=64)
        with self.assertRaisesRegex(ValueError, "v_head_dim"):
            dualkv.precompile(head_dim=192, num_q_heads=4, num_kv_heads=2,
                              arch="sm_80", v_head_dim=128.0)
        # The library's refusal: a window's backward is the atomic set.
        with self.assertRaisesRegex(ValueError, "sliding window"):
            dualkv.precompile(head_dim=64, num_q_heads=4, num_kv_heads=2,
                              arch="sm_80", window=128, deterministic=True)


if __name__ == "__main__":
    unittest.main()
