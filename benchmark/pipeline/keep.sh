# Sourced by the pipeline's benchmark scripts, which set OUT (the runs' output folders) and RES (the results kept in
# the repository), and SAMPLES, a pattern of the run names whose held-out samples are kept too (gzipped).

# run NAME COMMAND...: runs COMMAND with --output_dir $OUT/NAME and keeps its metrics and flags under $RES/NAME; a run
# whose results are kept is not run again (delete its folder under $RES to redo it)
run() {
    local name=$1; shift
    [ -f "$RES/$name/metrics.jsonl" ] && return
    "$@" --output_dir "$OUT/$name"
    mkdir -p "$RES/$name"; cp "$OUT/$name/metrics.jsonl" "$OUT/$name/args.json" "$RES/$name/"
    case $name in
        ${SAMPLES:-}) cp -r "$OUT/$name/eval_samples" "$RES/$name/"; gzip -9f "$RES/$name"/eval_samples/*.jsonl ;;
    esac
}

# model NAME RUN...: NAME's model is trained again (its kept results dropped) when a RUN that starts from it is not kept
# and the model is not in $OUT
model() {
    local name=$1; shift
    [ -f "$OUT/$name/config.json" ] && return
    for r in "$@"; do [ -f "$RES/$r/metrics.jsonl" ] || { rm -rf "${RES:?}/$name"; return; }; done
}
