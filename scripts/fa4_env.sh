# Source on the GPU machine after scripts/gpu_env.sh, once scripts/fa4_pack.py has unpacked both parts into
# .fa4/site: FlashAttention-4 on PYTHONPATH. The DSL's own .pth (which puts nvidia_cutlass_dsl/dsl_packages on
# sys.path) is read only in site-packages, so that folder is named here too.
FA4_SITE=$PWD/.fa4/site
export PYTHONPATH=$FA4_SITE:$FA4_SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
