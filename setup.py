"""Maps the top-level backends/, plugins/ and models/ folders into the mindspec namespace, and the
top-level configs/ (ready-made MindIE config.json files) to mindspec/configs/ in the wheel."""
from setuptools import find_packages, setup

NAMESPACED = ("backends", "plugins", "models")

packages = find_packages(include=["mindspec", "mindspec.*"])
package_dir = {"mindspec": "mindspec"}
for top in NAMESPACED:
    package_dir[f"mindspec.{top}"] = top
    packages += [f"mindspec.{name}" for name in find_packages(include=[top, f"{top}.*"])]
# configs/ holds only JSON (no __init__.py): a data-only package, found by
# mindspec.config.defaults.shipped_config_path
package_dir["mindspec.configs"] = "configs"
packages.append("mindspec.configs")

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={"mindspec": ["assets/**/*"], "mindspec.configs": ["*.json"],
                  "mindspec.backends.cpu": ["*.cpp"]},  # rows_gemm.cpp, built at run time
    include_package_data=True,
)
