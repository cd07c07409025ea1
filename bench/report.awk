# One benchmark CSV (bench/results.rs columns) as a markdown table.
# bench,case,metric,unit,n,median,p99,min,max,baseline,ratio,goal,verdict,commit,machine
BEGIN {
    FS = ","
    print "| case | measure | median | p99 | min–max | n | baseline (same run) | ratio | goal |"
    print "|---|---|---:|---:|---:|---:|---:|---:|---|"
}
function u(unit) {
    if (unit == "us") return "µs"
    if (unit == "x") return "×"
    return unit
}
function v(x, unit) {
    if (x == "") return "–"
    return x " " u(unit)
}
NR > 1 {
    unit = $4
    range = ($8 == "" ? "–" : $8 "–" $9)
    goal = ($12 == "" ? "" : $12 ": " ($13 == "met" ? "met" : "**" $13 "**"))
    ratio = ($11 == "" ? "–" : $11)
    printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", $2, $3, v($6, unit), v($7, unit), range, $5, v($10, unit), ratio, goal
}
