# lit configuration of DualKV's IR tests.
import os
import lit.formats

config.name = "DualKV"
config.test_format = lit.formats.ShTest(execute_external=False)
config.suffixes = [".mlir", ".test"]
config.excludes = ["Inputs", "CMakeLists.txt", "lit.cfg.py", "lit.site.cfg.py.in"]
config.test_source_root = os.path.dirname(__file__)
config.test_exec_root = os.path.join(os.path.dirname(config.dualkv_tools_dir), "tests", "lit")

path = os.pathsep.join([config.dualkv_tools_dir, config.llvm_tools_dir,
                        os.path.join(config.cuda_root, "bin"), config.environment.get("PATH", os.environ["PATH"])])
config.environment["PATH"] = path
config.substitutions.append(("%templates", os.path.join(config.dualkv_src_root, "templates")))
config.substitutions.append(("%python", "python3"))
if os.path.exists(os.path.join(config.cuda_root, "bin", "ptxas")):
    config.available_features.add("ptxas")
# The library and the Python package, for tests that check what a later
# process finds (dualkv-aot --into-cache).
config.substitutions.append(("%dualkv_lib", os.path.join(os.path.dirname(config.dualkv_tools_dir), "libdualkv.so")))
config.substitutions.append(("%dualkv_python", os.path.join(config.dualkv_src_root, "python")))
