"""setuptools' build backend, less its notice on editable installs (pyproject's build-backend).

pyproject's package-dir installs the repository's kernels/ and interop/ as moe_jax.kernels and
moe_jax.interop. An editable install of such a mapping is served by an import finder, and
setuptools then warns that folders in the working directory named like the package may take
precedence over it. The only such folder here is moe_jax/ itself, the very source the finder
serves (kernels/ and interop/ are reached only through it), so the notice is filtered; every hook
is otherwise setuptools' own.
"""

import warnings

from setuptools import build_meta as _setuptools
from setuptools.warnings import InformationOnly

build_sdist = _setuptools.build_sdist
build_wheel = _setuptools.build_wheel
get_requires_for_build_sdist = _setuptools.get_requires_for_build_sdist
get_requires_for_build_wheel = _setuptools.get_requires_for_build_wheel
get_requires_for_build_editable = _setuptools.get_requires_for_build_editable
prepare_metadata_for_build_wheel = _setuptools.prepare_metadata_for_build_wheel
prepare_metadata_for_build_editable = _setuptools.prepare_metadata_for_build_editable


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Editable installation", InformationOnly)
        return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
