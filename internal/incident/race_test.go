//go:build race

package incident

// raceDetector: built with -race, whose shadow memory and bookkeeping add
// to every allocation's footprint.
const raceDetector = true
