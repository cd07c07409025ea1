# Replaces the text between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` in a page with the
# file `dir/NAME.md` (left as it is when that file does not exist).
{
    if (match($0, /^<!-- bench:[a-z_]+ -->$/)) {
        name = substr($0, 12, length($0) - 15)
        file = dir "/" name ".md"
        print
        if ((getline line < file) > 0) {
            print line
            while ((getline line < file) > 0) print line
            close(file)
            skipping = 1
        }
        next
    }
    if (match($0, /^<!-- \/bench:[a-z_]+ -->$/)) {
        skipping = 0
        print
        next
    }
    if (!skipping) print
}
