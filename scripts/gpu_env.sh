# Sourced by the GPU scripts from the repository root: installs the wheels of .whl/, .whl2/ and
# .nixl/ (packages the machine's Python lacks) into a private directory and puts it and this
# checkout on PYTHONPATH.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
wheels=$(compgen -G ".whl/*.whl"; compgen -G ".whl2/*.whl"; compgen -G ".nixl/*.whl")
if [ -n "$wheels" ]; then
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/tandem-site $wheels || exit 1
  export PYTHONPATH=/tmp/tandem-site:$PWD
else
  export PYTHONPATH=$PWD
fi
