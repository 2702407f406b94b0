# shellcheck shell=bash
# The registry of methods (summarize_from_feedback_details/methods.tsv; Python reads it as
# summarize_from_feedback_details/methods.py's METHODS) for the shell scripts: hello_world.sh and
# sbatches/common.sh source this file.
METHODS_TSV="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/summarize_from_feedback_details/methods.tsv"
# method_names [SCRIPT]: the names of the registry's rows in order, those trained by SCRIPT if given
method_names() {
    awk -F'\t' -v script="${1:-}" '!/^#/ && NF && (script == "" || $4 == script) {printf "%s%s", sep, $1; sep = " "}' \
        "$METHODS_TSV"
}
# sampled_method_names: the rows hello_world.sh runs at PPO's episodes per update (samples a number)
sampled_method_names() {
    awk -F'\t' '!/^#/ && NF && $5 != "-" {printf "%s%s", sep, $1; sep = " "}' "$METHODS_TSV"
}
# method_row NAME: "script samples flags..." of NAME's row (nothing for a name the registry lacks)
method_row() {
    awk -F'\t' -v name="$1" '!/^#/ && $1 == name {print $4, $5, $6}' "$METHODS_TSV"
}
