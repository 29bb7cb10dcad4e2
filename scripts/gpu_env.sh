# Source at the start of every command on the lent GPU machine (see ../shared/device/README.md):
# installs the carried wheels (.whl/, filled by ../shared/device/wheelhouse.sh) into a temp site dir.
SITE=$(python3 -c 'import tempfile; print(tempfile.gettempdir())')/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
