# shellcheck shell=bash
# Sourced by scaling.sh and compare.sh, the sweeps over tiny sizes x seeds: one reading of their
# command line and of SIZES and SEEDS, so the two scripts refuse the same mistakes the same way.

# parse_sweep_args USAGE ARGS...: --force into the array `force`; SIZES and SEEDS (space-separated)
# into the arrays `sizes` and `seeds`, each a tiny size name or a number; anything else: exit 2
parse_sweep_args() {
    local usage=$1 arg size seed
    shift
    force=()
    for arg in "$@"; do
        case "$arg" in
            --force) force=(--force) ;;
            *) echo "usage: $usage $0 [--force]" >&2; exit 2 ;;
        esac
    done
    read -ra sizes <<<"$SIZES"
    read -ra seeds <<<"$SEEDS"
    for size in ${sizes[@]+"${sizes[@]}"}; do
        [[ $size =~ ^[a-z]+$ ]] || { echo "SIZES: '$size' is not a tiny size name (s, m, l)" >&2; exit 2; }
    done
    for seed in ${seeds[@]+"${seeds[@]}"}; do
        [[ $seed =~ ^[0-9]+$ ]] || { echo "SEEDS: '$seed' is not a seed" >&2; exit 2; }
    done
    if (( ${#sizes[@]} == 0 || ${#seeds[@]} == 0 )); then
        echo "SIZES and SEEDS must name at least one size and one seed" >&2; exit 2
    fi
}

# check_base_models: every size of `sizes` has its tiny base model (after ./hello_world.sh --data), in
# BASE_MODELS_DIR/TINY_PREFIX-tiny-<size> (sbatches/tiny_default.sh's tiny_arch_settings; unset: Pythia's)
check_base_models() {
    local size model
    for size in ${sizes[@]+"${sizes[@]}"}; do
        model=${BASE_MODELS_DIR:-models/tiny}/${TINY_PREFIX:-pythia}-tiny-$size
        [[ -d $model ]] ||
            { echo "no base model $model (the tiny sizes are those of tiny_models.SIZES)" >&2
              exit 2; }
    done
}
