//go:build !race

package incident

// raceDetector: built with -race (race_test.go).
const raceDetector = false
