"""Maps the top-level backends/, plugins/ and models/ folders into the mindspec namespace."""
from setuptools import find_packages, setup

NAMESPACED = ("backends", "plugins", "models")

packages = find_packages(include=["mindspec", "mindspec.*"])
package_dir = {"mindspec": "mindspec"}
for top in NAMESPACED:
    package_dir[f"mindspec.{top}"] = top
    packages += [f"mindspec.{name}" for name in find_packages(include=[top, f"{top}.*"])]

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={"mindspec": ["assets/**/*", "configs/*.json"]},
    include_package_data=True,
)
